//! Webhooks under the faults that need real processes: `kill -9` of a replica in the middle
//! of deliveries, and PostgreSQL restarted while events wait. Every committed payment's event
//! reaches the tests' receiver, verified by `oncepay_client::webhooks::verify` and by the
//! Standard Webhooks reference verifier (PyPI `standardwebhooks`,
//! scripts/standardwebhooks-verify.sh); duplicates carry their event's `webhook-id`.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::stream::{self, StreamExt};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::harness::{self, Server, Tenant};
use crate::webhook_receiver::{Receiver, Reply};

/// Webhook settings of every server here: deliveries on, private targets allowed (the
/// receiver is on 127.0.0.1), short timeouts (a lease of 2 s + 10 s) and schedule.
const WEBHOOK_ENV: &[(&str, &str)] = &[
    (
        "ONCEPAY_WEBHOOK_SECRET_KEY",
        "KioqKioqKioqKioqKioqKioqKioqKioqKioqKioqKio=",
    ),
    ("ONCEPAY_WEBHOOK_ALLOW_PRIVATE", "1"),
    ("ONCEPAY_WEBHOOK_TIMEOUT_MS", "2000"),
    ("ONCEPAY_WEBHOOK_POLL_MS", "50"),
    ("ONCEPAY_WEBHOOK_RETRY_SCHEDULE", "0.2,0.5,1,1,2,2,2,2,2,2"),
];

const WAIT: Duration = Duration::from_secs(120);

async fn subscribe(client: &reqwest::Client, server: &Server, tenant: &Tenant, receiver: &Receiver) {
    let answer = client
        .post(format!("{}/webhook-endpoints", server.address))
        .bearer_auth(&tenant.api_key)
        .header("Idempotency-Key", Uuid::new_v4().to_string())
        .json(&json!({ "url": receiver.url() }))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 201);
    let body: serde_json::Value = answer.json().await.unwrap();
    receiver.set_secret(body["secret"].as_str().unwrap());
}

/// `n` keyed payments of 1, 16 at a time, round robin over `servers`, each retried with its
/// key until answered (a server may die or the database restart meanwhile).
async fn pay(client: &reqwest::Client, servers: &[String], tenant: &Tenant, n: usize) -> Vec<String> {
    stream::iter(0..n)
        .map(|i| async move {
            let key = Uuid::new_v4().to_string();
            for attempt in 0..200 {
                let server = &servers[(i + attempt) % servers.len()];
                let sent = client
                    .post(format!("{server}/payments"))
                    .bearer_auth(&tenant.api_key)
                    .header("Idempotency-Key", &key)
                    .json(&json!({ "amount": 1 }))
                    .send()
                    .await;
                if let Ok(answer) = sent {
                    if answer.status() == 201 {
                        let body: serde_json::Value = answer.json().await.unwrap();
                        return body["id"].as_str().unwrap().to_owned();
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("payment {i} not answered");
        })
        .buffer_unordered(16)
        .collect()
        .await
}

/// Waits for every committed payment's event, then checks what arrived (signatures, one id
/// per event, nothing uncommitted) and runs the reference verifier over every message.
async fn every_event_arrived(
    pool: &PgPool,
    tenant: &Tenant,
    receiver: &Receiver,
    acknowledged: &[String],
) -> crate::webhook_receiver::Report {
    let committed: Vec<(Uuid,)> = sqlx::query_as("SELECT payment_id FROM payments WHERE tenant_id = $1")
        .bind(tenant.id)
        .fetch_all(pool)
        .await
        .unwrap();
    let expected: BTreeMap<String, Vec<&str>> = committed
        .iter()
        .map(|(id,)| (id.to_string(), vec!["payment.succeeded"]))
        .collect();
    for id in acknowledged {
        assert!(
            expected.contains_key(id),
            "an acknowledged payment {id} is not in the database"
        );
    }
    receiver.wait_for_acknowledged(expected.len(), WAIT).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = receiver.check(&expected);
    eprintln!(
        "webhooks: {} events of {} committed payments ({} acknowledged to the client) in {} messages, {} duplicates",
        report.events,
        expected.len(),
        acknowledged.len(),
        report.messages,
        report.duplicates
    );
    let file = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("webhooks-{}.json", tenant.id));
    let written = receiver.write_for_reference_verifier(&file);
    let output = tokio::process::Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/standardwebhooks-verify.sh"
    ))
    .arg(&file)
    .output()
    .await
    .expect("the reference verifier runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the reference verifier refused: {stdout} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(stdout.trim(), format!("verified={written}"));
    report
}

/// Messages whose `webhook-id` the receiver had already seen.
fn duplicates(receiver: &Receiver) -> usize {
    let messages = receiver.messages();
    let ids: std::collections::HashSet<&str> = messages.iter().map(|m| m.id.as_str()).collect();
    messages.len() - ids.len()
}

#[tokio::test]
#[ignore = "stops PostgreSQL and kills processes: run with `make chaos`"]
async fn a_replica_killed_mid_delivery_loses_no_event() {
    let pool = harness::pool().await;
    let tenant = harness::tenant(&pool).await;
    // Server 0 alone delivers at first; 1 and 2 only take payments. So the attempts in
    // flight when server 0 dies are its own.
    let api_only: Vec<(&str, &str)> = WEBHOOK_ENV
        .iter()
        .copied()
        .chain([("ONCEPAY_WEBHOOK_CONCURRENCY", "0")])
        .collect();
    let mut servers = vec![
        Server::start(WEBHOOK_ENV).await,
        Server::start(&api_only).await,
        Server::start(&api_only).await,
    ];
    let addresses: Vec<String> = servers.iter().map(|s| s.address.clone()).collect();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let receiver = Receiver::start().await;
    // Slow answers: attempts are in flight when the replica dies.
    receiver.set_delay(Duration::from_millis(300));
    subscribe(&client, &servers[1], &tenant, &receiver).await;

    let paying = pay(&client, &addresses[1..], &tenant, 120);
    let killer = async {
        while receiver.in_flight() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        servers[0].kill9().await;
    };
    let (acknowledged, ()) = tokio::join!(paying, killer);
    // Another replica takes over once the dead one's leases run out.
    servers.push(Server::start(WEBHOOK_ENV).await);
    // The receiver read the killed replica's last requests and answered them into closed
    // connections, so it counts those events as arrived while oncepay never learned of it:
    // they come again from the new replica, with the same id, once their leases (2 s + 10 s)
    // have run out. The new replica delivers every other event sooner than that, so wait for
    // the first duplicate before the check (the 04:54 CI run passed without this wait only
    // because the rest of the deliveries happened to take longer than a lease).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while duplicates(&receiver) == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let report = every_event_arrived(&pool, &tenant, &receiver, &acknowledged).await;
    assert!(
        report.duplicates >= 1,
        "the kill interrupted no delivery: the test proved nothing"
    );
    for server in &mut servers[1..] {
        server.assert_alive();
    }
}

#[tokio::test]
#[ignore = "stops PostgreSQL and kills processes: run with `make chaos`"]
async fn postgres_restarted_while_events_wait_loses_no_event() {
    let pool = harness::pool().await;
    let tenant = harness::tenant(&pool).await;
    let mut servers = [Server::start(WEBHOOK_ENV).await, Server::start(WEBHOOK_ENV).await];
    let addresses: Vec<String> = servers.iter().map(|s| s.address.clone()).collect();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let receiver = Receiver::start().await;
    // The receiver fails the first attempt of every event: retries are due across the restart.
    receiver.script(|m| {
        if m.nth == 1 {
            Reply::Status(500)
        } else {
            Reply::Status(200)
        }
    });
    receiver.set_delay(Duration::from_millis(100));
    subscribe(&client, &servers[0], &tenant, &receiver).await;

    let mut acknowledged = pay(&client, &addresses, &tenant, 60).await;
    harness::stop_postgres().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    harness::start_postgres().await;
    acknowledged.extend(pay(&client, &addresses, &tenant, 60).await);
    let pool = harness::pool().await;
    every_event_arrived(&pool, &tenant, &receiver, &acknowledged).await;
    for server in &mut servers {
        server.assert_alive();
    }
}
