//! `kill -9` of one of three servers in the middle of a stream of card top-ups against a real
//! processor emulator (localstripe): every top-up ends charged at most once and credited
//! exactly once iff charged, the killed server's unfinished ones finished by the others'
//! completers or by the clients' retries with their keys, and the audit (reading the
//! processor's PaymentIntents) clean.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use crate::harness::{self, Server};
use crate::stripe::{Localstripe, API_KEY};

const TOP_UPS: usize = 90;
const AMOUNT: i64 = 700;

#[tokio::test]
#[ignore = "kills processes: run with `make chaos`"]
async fn a_server_killed_amid_top_ups_charges_each_card_at_most_once() {
    let pool = harness::pool().await;
    let tenant = harness::tenant(&pool).await;
    let stripe = Localstripe::start().await;
    let env = [
        ("ONCEPAY_PROCESSOR_URL", stripe.url.as_str()),
        ("ONCEPAY_PROCESSOR_API_KEY", API_KEY),
        ("ONCEPAY_PROCESSOR_TIMEOUT_MS", "1000"),
        ("ONCEPAY_COMPLETER_AFTER_SECS", "2"),
    ];
    let mut servers = [
        Server::start(&env).await,
        Server::start(&env).await,
        Server::start(&env).await,
    ];
    let addresses: Vec<String> = servers.iter().map(|s| s.address.clone()).collect();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let send = |address: &str, key: &str| {
        client
            .post(format!("{address}/accounts/main/top-ups"))
            .bearer_auth(&tenant.api_key)
            .header("Idempotency-Key", key)
            .json(&json!({ "amount": AMOUNT, "payment_method": "pm_card_visa" }))
            .send()
    };
    let answered = AtomicUsize::new(0);
    let unanswered = AtomicUsize::new(0);
    let keys: Vec<String> = (0..TOP_UPS)
        .map(|i| format!("chaos-top-up-{i}-{}", uuid::Uuid::new_v4()))
        .collect();
    let burst = stream::iter(0..TOP_UPS).for_each_concurrent(12, |i| {
        let (keys, addresses, answered, unanswered, send) = (&keys, &addresses, &answered, &unanswered, &send);
        async move {
            if send(&addresses[i % 3], &keys[i]).await.is_err() {
                unanswered.fetch_add(1, Ordering::Relaxed);
            }
            answered.fetch_add(1, Ordering::Relaxed);
        }
    });
    let killer = async {
        while answered.load(Ordering::Relaxed) < TOP_UPS / 3 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        servers[0].kill9().await;
    };
    tokio::join!(burst, killer);
    let unanswered = unanswered.load(Ordering::Relaxed);
    eprintln!("kill -9: {unanswered} of {TOP_UPS} top-ups got no answer from the killed server");
    assert!(unanswered > 0, "the kill interrupted nothing: the test proved nothing");

    // Every client retries with its key on the live servers until a final answer.
    let mut ids: HashMap<String, String> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    for (i, key) in keys.iter().enumerate() {
        loop {
            assert!(Instant::now() < deadline, "no final answer for {key}");
            if let Ok(answer) = send(&addresses[1 + i % 2], key).await {
                let status = answer.status().as_u16();
                let body: Value = answer.json().await.unwrap_or_default();
                if status == 201 {
                    ids.insert(key.clone(), body["id"].as_str().unwrap().to_owned());
                    break;
                }
                assert!(matches!(status, 409 | 503), "{key}: {status} {body}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    // One succeeded PaymentIntent per top-up, none without its top-up, the balance credited
    // once per top-up.
    let intents = stripe.intents().await;
    let mut succeeded: HashMap<&str, usize> = HashMap::new();
    for intent in intents.iter().filter(|i| i["status"] == "succeeded") {
        *succeeded
            .entry(intent["metadata"]["oncepay_top_up_id"].as_str().unwrap_or(""))
            .or_default() += 1;
    }
    for id in ids.values() {
        assert_eq!(succeeded.get(id.as_str()), Some(&1), "top-up {id}");
    }
    assert_eq!(
        succeeded.values().sum::<usize>(),
        TOP_UPS,
        "no charge without its top-up"
    );
    let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE tenant_id = $1 AND account_id = 'main'")
        .bind(tenant.id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        balance,
        tenant.opening + AMOUNT * TOP_UPS as i64,
        "credited exactly once each"
    );
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .args(["audit", "--json", "--tenant", &tenant.id.to_string()])
        .env("DATABASE_URL", harness::database_url())
        .env("ONCEPAY_PROCESSOR_URL", &stripe.url)
        .env("ONCEPAY_PROCESSOR_API_KEY", API_KEY)
        .output()
        .await
        .unwrap();
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["clean"], true, "{report:#}");
    eprintln!(
        "processor: {} PaymentIntents, {TOP_UPS} succeeded, {} never confirmed",
        intents.len(),
        report["warnings"]["unconfirmed_intents"]["count"]
    );
    for server in &mut servers[1..] {
        server.assert_alive();
    }
}
