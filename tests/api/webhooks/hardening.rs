//! Webhooks against receivers and tenants as they really behave (docs/webhooks.md): any answer is recorded and none stops another tenant's deliveries; a message given up
//! is that message alone, an endpoint is disabled only by 410 or by failing for
//! `ONCEPAY_WEBHOOK_DISABLE_AFTER_SECS`, its events kept until it is enabled again; a replica's
//! own failure never counts against the receiver; no event is lost to an endpoint created at
//! the same moment; only global addresses, no proxy; at most `ONCEPAY_WEBHOOK_MAX_ENDPOINTS`
//! endpoints, and a tenant's slow endpoints leave a share of the slots to the others; a
//! replayed creation answers alike on every replica and never with a later secret.
//!
//! Tests whose claim is that something did *not* happen (nothing re-sent, nothing attempted)
//! run on a database of their own, where only their own replicas deliver.

use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use serde_json::json;
use sqlx::Connection;
use uuid::Uuid;

use oncepay::domain::MissingKeyPolicy;

use super::{delivering, endpoints_stored, pay, refund, subscribe, subscribe_as, wait_until, WAIT};
use crate::commands::{free_port, serve_logged, stop_logged, wait_until_ready};
use crate::support::helpers::{
    drop_database, metric_value, new_key, new_tenant, server_url, spawn_app_on_own_database_with, TestApp,
};
use crate::support::webhook_receiver::{Receiver, Reply};

/// `(state, count)` of the tenant's deliveries.
async fn delivery_states(pool: &sqlx::PgPool, tenant: Uuid) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT state, count(*) FROM webhook_deliveries WHERE tenant_id = $1 GROUP BY state ORDER BY state")
        .bind(tenant)
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn pay_as(app: &TestApp, api_key: &str) {
    let answer = app
        .post_as(api_key, "/payments", Some(&new_key()), &json!({ "amount": 10 }))
        .await;
    assert_eq!(answer.status, 201, "{}", answer.body);
}

/// The endpoint as `GET /webhook-endpoints` lists it.
async fn listed(app: &TestApp, endpoint: &str) -> serde_json::Value {
    let all = app.get("/webhook-endpoints").await.body;
    all.as_array()
        .unwrap()
        .iter()
        .find(|e| e["id"] == endpoint)
        .cloned()
        .unwrap_or_else(|| panic!("{endpoint} not listed: {all}"))
}

/// One receiver answers 200 with a NUL byte, or with bytes that are not UTF-8, beside
/// another tenant's plain receiver, on one replica: both get every event exactly once, and
/// every attempt is recorded (before migrations/V22 and the head's escaping, the answer's
/// head was sent as text holding U+0000, PostgreSQL refused the whole batch of results, other
/// tenants' included, and every one of them was sent again after its lease).
#[tokio::test]
async fn receivers_answering_any_bytes_beside_another_tenants_each_get_every_event_once() {
    let (app, url) = spawn_app_on_own_database_with("any_answer", delivering).await;
    let (_, other_key) = new_tenant(&app.pool, MissingKeyPolicy::Reject).await;
    let odd = Receiver::start().await;
    let mut n = 0;
    odd.script(move |_| {
        n += 1;
        match n % 3 {
            0 => Reply::Body(200, b"a\0b".to_vec()),
            1 => Reply::Body(200, b"\xff\xfe\x00binary\xc3".to_vec()),
            _ => Reply::Body(202, "\\x00 caf\u{e9}".as_bytes().to_vec()),
        }
    });
    let plain = Receiver::start().await;
    subscribe(&app, &odd, None).await;
    subscribe_as(&app, &other_key, &plain, None).await;
    for _ in 0..30 {
        pay(&app, 10).await;
        pay_as(&app, &other_key).await;
    }
    odd.wait_for_acknowledged(30, WAIT).await;
    plain.wait_for_acknowledged(30, WAIT).await;
    // Every result recorded: nothing left pending to be sent again after its lease.
    wait_until(
        "every delivery recorded as delivered",
        Duration::from_secs(20),
        || async {
            let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE state <> 'delivered'")
                .fetch_one(&app.pool)
                .await
                .unwrap();
            pending == 0
        },
    )
    .await;
    assert_eq!(odd.messages().len(), 30, "the odd receiver got a message twice");
    assert_eq!(plain.messages().len(), 30, "the plain receiver got a message twice");
    let heads: Vec<String> = sqlx::query_scalar("SELECT response_head FROM webhook_attempts WHERE tenant_id = $1")
        .bind(app.tenant_id)
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(heads.len(), 30);
    assert!(heads.contains(&"a\\u{0}b".to_owned()), "{heads:?}");
    assert!(heads.contains(&"\\xff\\xfe\\u{0}binary\\xc3".to_owned()), "{heads:?}");
    assert!(heads.contains(&"\\\\x00 caf\u{e9}".to_owned()), "{heads:?}");
    drop_database(&url).await;
}

/// A receiver that sends its 2xx status line and then stalls in its body has answered: one
/// attempt, recorded as a delivery once the head's read gave up (its own second), not after
/// the attempt's timeout (10 s here; the receiver holds the body for 30).
#[tokio::test]
async fn a_2xx_whose_body_stalls_after_its_status_is_a_delivery() {
    let (app, url) = spawn_app_on_own_database_with("stalled_body", |s| {
        delivering(s);
        s.webhooks.timeout = Duration::from_secs(10);
    })
    .await;
    let receiver = Receiver::start().await;
    receiver.script(|_| Reply::Stall(200));
    subscribe(&app, &receiver, None).await;
    for _ in 0..3 {
        pay(&app, 10).await;
    }
    wait_until("three deliveries delivered", Duration::from_secs(20), || async {
        delivery_states(&app.pool, app.tenant_id).await == [("delivered".to_owned(), 3)]
    })
    .await;
    let attempts: Vec<(i32, Option<i16>, Option<String>, i32)> =
        sqlx::query_as("SELECT attempt, status, response_head, latency_ms FROM webhook_attempts WHERE tenant_id = $1")
            .bind(app.tenant_id)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(attempts.len(), 3, "{attempts:?}");
    assert!(
        attempts
            .iter()
            .all(|(n, status, head, _)| *n == 1 && *status == Some(200) && head.as_deref() == Some("abc")),
        "{attempts:?}"
    );
    // Ended by the head's read (1 s), not held until the attempt's timeout (10 s).
    assert!(
        attempts.iter().all(|(.., latency_ms)| *latency_ms < 5_000),
        "{attempts:?}"
    );
    assert_eq!(receiver.messages().len(), 3);
    drop_database(&url).await;
}

/// A receiver with a bug in one handler answers 400 to `payment.refunded` only: those
/// messages use up the schedule and are given up, each alone; the endpoint stays enabled and
/// every `payment.succeeded`, those made after the give-ups included, arrives.
#[tokio::test]
async fn one_refused_event_type_gives_up_those_messages_alone_and_the_endpoint_stays_enabled() {
    let (app, url) = spawn_app_on_own_database_with("one_refused_type", |s| {
        delivering(s);
        s.webhooks.retry_schedule = vec![Duration::from_millis(100); 3];
    })
    .await;
    let receiver = Receiver::start().await;
    receiver.script(|m| {
        if m.event_type == "payment.refunded" {
            Reply::Status(400)
        } else {
            Reply::Status(200)
        }
    });
    let endpoint = subscribe(&app, &receiver, None).await;
    for _ in 0..5 {
        let payment = pay(&app, 10).await;
        refund(&app, &payment).await;
    }
    let given_up = || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM webhook_deliveries d JOIN webhook_events ev USING (tenant_id, event_id)
              WHERE d.tenant_id = $1 AND ev.event_type = 'payment.refunded' AND d.state = 'given_up'",
        )
        .bind(app.tenant_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
        n
    };
    wait_until("the five refunds given up", WAIT, || async { given_up().await == 5 }).await;
    assert_eq!(listed(&app, &endpoint).await["status"], "enabled");
    for _ in 0..10 {
        pay(&app, 10).await;
    }
    receiver.wait_for_acknowledged(15, WAIT).await;
    let succeeded: std::collections::HashSet<String> = receiver
        .messages()
        .into_iter()
        .filter(|m| m.event_type == "payment.succeeded" && m.reply.is_success())
        .map(|m| m.resource)
        .collect();
    assert_eq!(succeeded.len(), 15);
    let endpoint_now = listed(&app, &endpoint).await;
    assert_eq!(endpoint_now["status"], "enabled", "{endpoint_now}");
    // Each refund's message was tried the whole schedule: four attempts, then given up.
    let refunds = receiver
        .messages()
        .into_iter()
        .filter(|m| m.event_type == "payment.refunded")
        .count();
    assert_eq!(refunds, 20);
    drop_database(&url).await;
}

/// "While attempts kept failing": a pause with no attempt at all longer than the schedule's
/// longest wait (nothing was being retried) ends a failing stretch, so the first failure
/// after it starts a new one instead of disabling the endpoint at once for the old stretch's
/// age. A stretch that keeps failing past the disable-after still disables, counted and
/// logged as `failing`.
#[tokio::test]
async fn a_quiet_pause_ends_a_failing_stretch_and_a_failing_one_disables_counted() {
    let (app, url) = spawn_app_on_own_database_with("failing_pause", |s| {
        delivering(s);
        s.webhooks.retry_schedule = vec![Duration::from_millis(50); 3];
        s.webhooks.disable_after = Duration::from_secs(1);
        // The pause that ends a stretch: 0.5 + 0.055 + the poll + 1 s, under the 2.5 s below.
        s.webhooks.timeout = Duration::from_millis(500);
        assert!(s.webhooks.failing_pause() < Duration::from_secs(2));
    })
    .await;
    let receiver = Receiver::start().await;
    receiver.script(|_| Reply::Status(500));
    let endpoint = subscribe(&app, &receiver, None).await;
    pay(&app, 10).await;
    wait_until("the first message given up", WAIT, || async {
        delivery_states(&app.pool, app.tenant_id).await == [("given_up".to_owned(), 1)]
    })
    .await;
    // Quiet for longer than the disable-after and the pause: no attempt at all.
    tokio::time::sleep(Duration::from_millis(2_500)).await;

    let started = Instant::now();
    pay(&app, 10).await;
    wait_until("the second message's first attempt", WAIT, || async {
        receiver.messages().len() >= 5
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        listed(&app, &endpoint).await["status"],
        "enabled",
        "one failure after a quiet pause disables nothing"
    );

    // Failing on and on, with no pause longer than the schedule's waits: disabled, a
    // disable-after after the stretch's first failure (the one after the pause).
    wait_until("disabled for failing", WAIT, || async {
        pay(&app, 10).await;
        tokio::time::sleep(Duration::from_millis(40)).await;
        listed(&app, &endpoint).await["status"] == "disabled"
    })
    .await;
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "after the disable-after: {:?}",
        started.elapsed()
    );
    assert_eq!(listed(&app, &endpoint).await["disabled_reason"], "failing");
    let text = app.metrics().await;
    assert_eq!(
        metric_value(&text, r#"oncepay_webhook_endpoints_disabled_total{reason="failing"}"#),
        1.0,
        "{text}"
    );
    drop_database(&url).await;
}

/// An endpoint none of whose attempts succeeded for the disable-after (1 s here) while they
/// kept failing is disabled; its events are kept (held), those of changes made while it is
/// disabled too, and nothing is sent to it; enabled again (idempotently), it gets them all.
/// 410 Gone disables at once, its delivery kept the same way.
#[tokio::test]
async fn an_endpoint_disabled_for_failing_or_gone_keeps_its_events_until_it_is_enabled() {
    let (app, url) = spawn_app_on_own_database_with("disable_after", |s| {
        delivering(s);
        s.webhooks.retry_schedule = vec![Duration::from_millis(200); 50];
        s.webhooks.disable_after = Duration::from_secs(1);
    })
    .await;
    let failing = Receiver::start().await;
    failing.script(|_| Reply::Status(500));
    let gone = Receiver::start().await;
    gone.script(|_| Reply::Status(410));
    let failing_id = subscribe(&app, &failing, None).await;
    let gone_id = subscribe(&app, &gone, None).await;
    let first = pay(&app, 10).await;

    wait_until("both endpoints disabled", WAIT, || async {
        let failing = listed(&app, &failing_id).await;
        let gone = listed(&app, &gone_id).await;
        failing["status"] == "disabled" && gone["status"] == "disabled"
    })
    .await;
    assert_eq!(listed(&app, &failing_id).await["disabled_reason"], "failing");
    assert_eq!(listed(&app, &gone_id).await["disabled_reason"], "gone");
    assert_eq!(gone.messages().len(), 1, "410 is not retried");
    assert!(failing.messages().len() >= 3, "{} attempts", failing.messages().len());
    // A change made while they are disabled: its deliveries are written, held.
    let second = pay(&app, 10).await;
    wait_until("every delivery held", WAIT, || async {
        delivery_states(&app.pool, app.tenant_id).await == [("held".to_owned(), 4)]
    })
    .await;
    let (sent_to_failing, sent_to_gone) = (failing.messages().len(), gone.messages().len());
    failing.script(|_| Reply::Status(200));
    gone.script(|_| Reply::Status(200));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        (failing.messages().len(), gone.messages().len()),
        (sent_to_failing, sent_to_gone),
        "a disabled endpoint got a message"
    );

    for (endpoint, receiver) in [(&failing_id, &failing), (&gone_id, &gone)] {
        let key = new_key();
        let path = format!("/webhook-endpoints/{endpoint}/enable");
        let enabled = app.post(&path, Some(&key), &json!({})).await;
        assert_eq!(enabled.status, 200, "{}", enabled.body);
        assert_eq!(enabled.body["status"], "enabled");
        assert_eq!(enabled.body["id"], endpoint.as_str());
        let replayed = app.post(&path, Some(&key), &json!({})).await;
        assert_eq!((replayed.status, replayed.replayed()), (200, true));
        assert_eq!(replayed.body, enabled.body);
        receiver.wait_for_acknowledged(2, WAIT).await;
        let resources: std::collections::HashSet<String> = receiver
            .messages()
            .into_iter()
            .filter(|m| m.reply.is_success())
            .map(|m| m.resource)
            .collect();
        assert_eq!(resources, [first.clone(), second.clone()].into(), "{endpoint}");
        assert_eq!(listed(&app, endpoint).await["status"], "enabled");
    }
    // Another tenant's endpoint, or none: 404, stored and replayed like every decline.
    let key = new_key();
    let unknown = format!("/webhook-endpoints/{}/enable", Uuid::new_v4());
    app.post(&unknown, Some(&key), &json!({}))
        .await
        .assert_problem(404, "not_found");
    drop_database(&url).await;
}

/// A replica whose `ONCEPAY_WEBHOOK_SECRET_KEY` is not the one the endpoint's secret was
/// sealed with cannot sign: it sends nothing, records no attempt, counts nothing against the
/// receiver, and the delivery stays due; a replica with the right key delivers it.
#[tokio::test]
async fn a_replica_that_cannot_decrypt_a_secret_defers_without_counting_against_the_receiver() {
    let (creator, url) = spawn_app_on_own_database_with("wrong_key", |_| {}).await;
    let receiver = Receiver::start().await;
    let endpoint = subscribe(&creator, &receiver, None).await;
    for _ in 0..3 {
        pay(&creator, 10).await;
    }
    let wrong = TestApp::builder()
        .settings(|s| {
            s.database_url = server_url(&url);
            delivering(s);
            s.webhooks.secret_key = Some([7; 32]);
            s.webhooks.retry_schedule = vec![Duration::from_millis(100); 2];
            s.webhooks.disable_after = Duration::ZERO;
        })
        .tenant_of(&creator)
        .spawn()
        .await;
    wait_until("the wrong replica deferred the three", WAIT, || async {
        metric_value(
            &wrong.metrics().await,
            "oncepay_webhook_deliveries_total{outcome=\"deferred\"}",
        ) >= 3.0
    })
    .await;
    // Past the schedule, were these failures of the receiver's.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        receiver.messages().is_empty(),
        "a message went out unsigned or badly signed"
    );
    let (attempt_rows, attempts, failing_since): (i64, i64, Option<chrono::DateTime<chrono::Utc>>) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM webhook_attempts), (SELECT coalesce(sum(attempts), 0) FROM webhook_deliveries),
                (SELECT failing_since FROM webhook_endpoints WHERE endpoint_id = $1::uuid)",
    )
    .bind(&endpoint)
    .fetch_one(&creator.pool)
    .await
    .unwrap();
    assert_eq!((attempt_rows, attempts, failing_since), (0, 0, None));
    assert_eq!(
        delivery_states(&creator.pool, creator.tenant_id).await,
        [("pending".to_owned(), 3)]
    );
    assert_eq!(listed(&creator, &endpoint).await["status"], "enabled");
    drop(wrong);

    let _right = TestApp::builder()
        .settings(|s| {
            s.database_url = server_url(&url);
            delivering(s);
        })
        .tenant_of(&creator)
        .spawn()
        .await;
    receiver.wait_for_acknowledged(3, WAIT).await;
    drop_database(&url).await;
}

/// Such a replica defers every due delivery again every 5 s, and wrote an ERROR line for each:
/// a few endpoints buried its log. The server process (its own log) writes the line once a
/// minute, saying how many it held back; every deferral is still counted.
#[tokio::test]
async fn a_replica_that_cannot_sign_says_so_once_a_minute_not_once_a_delivery() {
    let (creator, url) = spawn_app_on_own_database_with("cannot_sign_log", |_| {}).await;
    let receiver = Receiver::start().await;
    subscribe(&creator, &receiver, None).await;
    for _ in 0..4 {
        pay(&creator, 10).await;
    }
    let (port, metrics_port) = (free_port(), free_port());
    let (mut server, logs) = serve_logged(&[
        ("DATABASE_URL", server_url(&url)),
        ("ONCEPAY_BIND", format!("127.0.0.1:{port}")),
        ("ONCEPAY_METRICS_BIND", format!("127.0.0.1:{metrics_port}")),
        ("ONCEPAY_LOG_FORMAT", "json".to_owned()),
        ("RUST_LOG", "warn".to_owned()),
        ("ONCEPAY_WEBHOOK_POLL_MS", "200".to_owned()),
        // Not the key the endpoint's secret was sealed with (the test apps' [42; 32]).
        ("ONCEPAY_WEBHOOK_SECRET_KEY", base64_of_sevens()),
    ]);
    wait_until_ready(&creator.client, port).await;
    let metrics = format!("http://127.0.0.1:{metrics_port}/metrics");
    // The four deferred twice: two claims 5 s apart.
    wait_until("the replica deferred each delivery twice", WAIT, || async {
        let Ok(answer) = creator.client.get(&metrics).send().await else {
            return false;
        };
        let exposition = answer.text().await.unwrap_or_default();
        metric_value(&exposition, "oncepay_webhook_deliveries_total{outcome=\"deferred\"}") >= 8.0
    })
    .await;
    let logs = stop_logged(&mut server, logs).await;
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|entry| {
            entry["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("this replica cannot sign"))
        })
        .collect();
    assert_eq!(lines.len(), 1, "{logs}");
    assert_eq!(lines[0]["level"], "ERROR", "{logs}");
    assert_eq!(lines[0]["deferred_since_last_line"], 0, "{logs}");
    assert!(receiver.messages().is_empty(), "a message went out unsigned");
    drop_database(&url).await;
}

fn base64_of_sevens() -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode([7u8; 32])
}

/// The issue's interleaving, made deterministic with a table lock: a payment begins, its
/// transaction waits on the locked accounts; meanwhile the tenant's first endpoint is
/// created; then the lock goes. Either the creation answers while the payment still waits,
/// and then the payment commits after it and its event must reach the endpoint (before
/// migrations/V22 it never did: the fan-out compared the two transactions' start times), or
/// the creation waits for the payment in flight (on the tenant's events lock), and answers
/// after it committed.
#[tokio::test]
async fn an_endpoint_created_while_a_payment_waits_gets_its_event_or_waits_for_it() {
    let (app, url) = spawn_app_on_own_database_with("creation_race", delivering).await;
    let receiver = Receiver::start().await;
    let mut locker = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut locker).await.unwrap();
    sqlx::query("LOCK TABLE accounts IN EXCLUSIVE MODE")
        .execute(&mut locker)
        .await
        .unwrap();
    let payer = app.clone();
    let payment = tokio::spawn(async move { pay(&payer, 10).await });
    let waiting = |kind: &'static str| {
        let pool = app.pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = $1 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            )
            .bind(kind)
            .fetch_one(&pool)
            .await
            .unwrap();
            n > 0
        }
    };
    wait_until("the payment waits on the locked table", Duration::from_secs(10), || {
        waiting("relation")
    })
    .await;

    let creator = app.clone();
    let url_of = receiver.url();
    let mut creation = tokio::spawn(async move {
        creator
            .post("/webhook-endpoints", Some(&new_key()), &json!({ "url": url_of }))
            .await
    });
    let answered_while_waiting = tokio::time::timeout(Duration::from_secs(2), &mut creation).await;
    let answered = answered_while_waiting.is_ok();
    let creation_waited_on_the_events_lock = waiting("advisory").await;
    sqlx::query("COMMIT").execute(&mut locker).await.unwrap();
    let payment = payment.await.unwrap();
    let created = match answered_while_waiting {
        Ok(created) => created.unwrap(),
        Err(_) => creation.await.unwrap(),
    };
    assert_eq!(created.status, 201, "{}", created.body);
    receiver.set_secret(created.body["secret"].as_str().unwrap());
    if answered {
        // The payment committed after the creation answered: its event is owed to it.
        receiver.wait_for_acknowledged(1, Duration::from_secs(20)).await;
        assert_eq!(receiver.messages()[0].resource, payment);
    } else {
        assert!(
            creation_waited_on_the_events_lock,
            "the creation neither answered nor waited on the tenant's events lock"
        );
        let after = pay(&app, 10).await;
        receiver.wait_for_acknowledged(1, WAIT).await;
        assert_eq!(receiver.messages()[0].resource, after);
    }
    drop_database(&url).await;
}

/// A change whose transaction began before an endpoint was created, and that writes after
/// the creation committed, sees the endpoint and its event reaches it: who gets an event is
/// decided by the order of the events' sequence, not by the transactions' start times.
#[tokio::test]
async fn a_payment_whose_transaction_began_before_an_endpoint_was_created_reaches_it() {
    let (app, url) = spawn_app_on_own_database_with("began_before", delivering).await;
    let receiver = Receiver::start().await;
    let mut tx = app.pool.begin().await.unwrap();
    let began: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()").fetch_one(&mut *tx).await.unwrap();
    let endpoint = subscribe(&app, &receiver, None).await;
    let paid: Uuid = sqlx::query_scalar(
        "SELECT (resource).payment_id FROM oncepay_pay($1, ROW(NULL, false, NULL, 'pay', 'POST', '/payments', 0, 1000, 201, '{}')::oncepay_claim_args, 'main', 7)",
    )
    .bind(app.tenant_id)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let created_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT created_at FROM webhook_endpoints WHERE endpoint_id = $1::uuid")
            .bind(&endpoint)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(began < created_at, "the payment's transaction began first");
    receiver.wait_for_acknowledged(1, Duration::from_secs(20)).await;
    assert_eq!(receiver.messages()[0].resource, paid.to_string());
    drop_database(&url).await;
}

/// Every spelling of an address that is not global unicast is refused at registration, the
/// IPv4 ones hidden inside IPv6 included, and nothing is stored.
#[tokio::test]
async fn an_address_that_is_not_global_unicast_is_refused_however_it_is_spelled() {
    let app = TestApp::builder()
        .settings(|s| s.webhooks.allow_private = false)
        .spawn()
        .await;
    for url in [
        "http://[64:ff9b::7f00:1]/",
        "http://[64:ff9b::a9fe:a9fe]/latest/meta-data",
        "http://[::127.0.0.1]/",
        "http://[2002:7f00:1::1]/",
        "http://[fec0::1]/",
        "http://198.18.0.1/",
        "http://[::ffff:0:7f00:1]/",
        "http://[::ffff:127.0.0.1]/",
        "http://169.254.169.254/latest/meta-data",
        "http://[fd00::1]/",
        "http://0.0.0.0:9/",
        "http://localhost:9/",
        "http://192.0.2.1/",
    ] {
        let answer = app
            .post("/webhook-endpoints", Some(&new_key()), &json!({ "url": url }))
            .await;
        answer.assert_problem(400, "invalid_request");
        assert!(
            answer.body["detail"].as_str().unwrap().contains("global unicast"),
            "{url}: {}",
            answer.body
        );
    }
    assert_eq!(endpoints_stored(&app).await, 0);
}

/// A migrated database of the test's own with one tenant: its URL, a pool, the tenant and
/// its API key.
async fn database_with_tenant(name_hint: &str) -> (String, sqlx::PgPool, Uuid, String) {
    let url = crate::support::helpers::empty_database(name_hint).await;
    oncepay::db::migrate(&url).await.unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let (tenant, api_key) = new_tenant(&pool, MissingKeyPolicy::Reject).await;
    (url, pool, tenant, api_key)
}

/// `oncepay serve`, the binary, on the database at `url` with deliveries to private addresses
/// allowed and a 50 ms poll, `env` added; its base URL.
fn serve(url: &str, env: &[(&str, &str)]) -> (tokio::process::Child, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_oncepay"));
    command
        .arg("serve")
        .env("DATABASE_URL", server_url(url))
        .env("ONCEPAY_BIND", format!("127.0.0.1:{port}"))
        .env("ONCEPAY_METRICS_BIND", "127.0.0.1:0")
        .env("ONCEPAY_WEBHOOK_ALLOW_PRIVATE", "1")
        .env("ONCEPAY_WEBHOOK_POLL_MS", "50")
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    for (name, value) in env {
        command.env(name, value);
    }
    (command.spawn().unwrap(), format!("http://127.0.0.1:{port}"))
}

/// Creates an endpoint for `receiver` through the server at `base` once it answers (503 until
/// it has reached its database), gives the receiver its secret, and pays once.
async fn subscribe_and_pay(base: &str, api_key: &str, receiver: &Receiver) {
    let client = crate::support::helpers::client();
    let mut created = None;
    for _ in 0..100 {
        let sent = client
            .post(format!("{base}/webhook-endpoints"))
            .bearer_auth(api_key)
            .header("Idempotency-Key", "serve-endpoint")
            .json(&json!({ "url": receiver.url() }))
            .send()
            .await;
        if let Ok(response) = sent.as_ref().map(|r| r.status()) {
            if response == 201 {
                created = Some(sent.unwrap().json::<serde_json::Value>().await.unwrap());
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let created = created.expect("the server created the endpoint within 10 s");
    receiver.set_secret(created["secret"].as_str().unwrap());
    let paid = client
        .post(format!("{base}/payments"))
        .bearer_auth(api_key)
        .header("Idempotency-Key", "serve-payment")
        .json(&json!({ "amount": 10 }))
        .send()
        .await
        .unwrap();
    assert_eq!(paid.status(), 201);
}

/// The deliveries' client takes no proxy from the environment (a proxy resolves the name
/// itself, past the rebinding guard): with `HTTP_PROXY` and `ALL_PROXY` pointing at a proxy
/// of the test's, `oncepay serve` delivers straight to the receiver, and the proxy sees no
/// connection.
#[tokio::test]
async fn deliveries_take_no_proxy_from_the_environment() {
    let (url, pool, _, api_key) = database_with_tenant("no_proxy").await;
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_url = format!("http://127.0.0.1:{}", proxy.local_addr().unwrap().port());
    let proxied = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = proxied.clone();
    let _proxy = tokio::spawn(async move {
        while let Ok((stream, _)) = proxy.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(stream);
        }
    });
    let proxy_env = ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY"].map(|name| (name, proxy_url.as_str()));
    let (_server, base) = serve(&url, &proxy_env);
    let receiver = Receiver::start().await;
    subscribe_and_pay(&base, &api_key, &receiver).await;
    receiver.wait_for_acknowledged(1, Duration::from_secs(30)).await;
    assert_eq!(
        proxied.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "a delivery went through the proxy"
    );
    pool.close().await;
    drop_database(&url).await;
}

/// A replica stopped gracefully (SIGTERM, as a rolling restart does) while an attempt is in
/// flight waits for its answer and records it before it exits: the delivery is delivered and
/// its attempt listed at once, not left to a lease that runs out and sends it again.
#[tokio::test]
async fn a_replica_stopped_gracefully_records_the_attempts_in_flight() {
    let (url, pool, tenant, api_key) = database_with_tenant("graceful_stop").await;
    let (port, ops) = (free_port(), free_port());
    let base = format!("http://127.0.0.1:{port}");
    let (mut server, logs) = serve_logged(&[
        ("DATABASE_URL", server_url(&url)),
        ("ONCEPAY_BIND", format!("127.0.0.1:{port}")),
        ("ONCEPAY_METRICS_BIND", format!("127.0.0.1:{ops}")),
        ("ONCEPAY_WEBHOOK_ALLOW_PRIVATE", "1".to_owned()),
        ("ONCEPAY_WEBHOOK_POLL_MS", "50".to_owned()),
    ]);
    let receiver = Receiver::start().await;
    receiver.set_delay(Duration::from_millis(1500));
    subscribe_and_pay(&base, &api_key, &receiver).await;
    wait_until("the attempt reaches the receiver", Duration::from_secs(10), || async {
        receiver.in_flight() == 1
    })
    .await;
    // Reads on the HTTP workers, whose connections join the pool the deliverer records with.
    let client = crate::support::helpers::client();
    let reads = (0..32).map(|_| client.get(format!("{base}/accounts/main")).bearer_auth(&api_key).send());
    for read in futures_util::future::join_all(reads).await {
        assert_eq!(read.unwrap().status(), 200);
    }

    crate::commands::sigterm(&server);
    // Until the process is gone, `/readyz` on the operations listener answers 503 (found from
    // outside: it refused connections once the requests had drained, while the deliverer
    // still recorded its attempt, and the stopping replica looked dead).
    let readyz = format!("http://127.0.0.1:{ops}/readyz");
    let signalled = Instant::now();
    let mut not_503 = Vec::new();
    let status = loop {
        let answer = client
            .get(&readyz)
            .timeout(Duration::from_secs(1))
            .send()
            .await
            .map(|r| r.status().as_u16());
        if !matches!(answer, Ok(503)) {
            // Refused as the process leaves: it is gone a moment later.
            tokio::time::sleep(Duration::from_millis(300)).await;
            if server.try_wait().unwrap().is_none() {
                not_503.push(format!("{:?} after SIGTERM: {answer:?}", signalled.elapsed()));
            }
        }
        if let Some(status) = server.try_wait().unwrap() {
            break status;
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(20),
            "serve stops within 20 s of SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status.code(), Some(0), "a clean stop");
    assert!(not_503.is_empty(), "/readyz while the process stopped: {not_503:#?}");
    assert_eq!(
        receiver.acknowledged().len(),
        1,
        "the receiver answered before the stop ended"
    );
    assert_eq!(
        delivery_states(&pool, tenant).await,
        [("delivered".to_owned(), 1)],
        "recorded before the process exited"
    );
    let attempts: Vec<(i32, Option<i16>)> =
        sqlx::query_as("SELECT attempt, status FROM webhook_attempts WHERE tenant_id = $1")
            .bind(tenant)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(attempts, [(1, Some(200))]);
    // Recorded at the first try, not after a failure (found from outside: "webhook attempts
    // not recorded yet; will try again ... being shutdown" at every such stop).
    let log = logs.await.unwrap();
    assert!(log.contains("stopped"), "the log was read: {log}");
    let complaints: Vec<&str> = log
        .lines()
        .filter(|l| (l.contains("WARN") || l.contains("ERROR")) && !l.contains("ONCEPAY_WEBHOOK_SECRET_KEY is unset"))
        .collect();
    assert!(complaints.is_empty(), "{complaints:#?}");
    pool.close().await;
    drop_database(&url).await;
}

/// Three hundred creations at once, each with its own key, for one URL: the first
/// `ONCEPAY_WEBHOOK_MAX_ENDPOINTS` (16) are created, every other one is refused 409
/// `too_many_endpoints`, stored and replayed like a decline; after a deletion there is room
/// for one more.
#[tokio::test]
async fn past_the_cap_an_endpoint_is_refused_and_the_refusal_replayed() {
    let app = TestApp::builder().spawn().await;
    assert_eq!(app.state.settings.webhooks.max_endpoints, 16);
    let receiver = Receiver::start().await;
    let keys: Vec<String> = (0..300).map(|_| new_key()).collect();
    let answers: Vec<(String, crate::support::helpers::Answer)> = futures_util::stream::iter(keys)
        .map(|key| {
            let app = app.clone();
            let url = receiver.url();
            async move {
                let answer = app.post("/webhook-endpoints", Some(&key), &json!({ "url": url })).await;
                (key, answer)
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let created: Vec<&crate::support::helpers::Answer> =
        answers.iter().map(|(_, a)| a).filter(|a| a.status == 201).collect();
    let refused: Vec<&(String, crate::support::helpers::Answer)> =
        answers.iter().filter(|(_, a)| a.status != 201).collect();
    assert_eq!(created.len(), 16);
    assert_eq!(refused.len(), 284);
    for (_, answer) in &refused {
        answer.assert_problem(409, "too_many_endpoints");
    }
    let stored: i64 =
        sqlx::query_scalar("SELECT count(*) FROM webhook_endpoints WHERE tenant_id = $1 AND deleted_at IS NULL")
            .bind(app.tenant_id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(stored, 16);
    let (key, _) = refused[0];
    let replay = app
        .post("/webhook-endpoints", Some(key), &json!({ "url": receiver.url() }))
        .await;
    replay.assert_problem(409, "too_many_endpoints");
    assert!(replay.replayed());
    let deleted = app
        .client
        .delete(app.url(&format!(
            "/webhook-endpoints/{}",
            created[0].body["id"].as_str().unwrap()
        )))
        .bearer_auth(&app.api_key)
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 204);
    let again = app
        .post(
            "/webhook-endpoints",
            Some(&new_key()),
            &json!({ "url": receiver.url() }),
        )
        .await;
    assert_eq!(again.status, 201, "{}", again.body);
}

/// One tenant's ten endpoints never answer (each attempt holds its slot for the whole 20 s
/// timeout); another tenant's endpoint answers at once. With 8 slots in the replica, the slow
/// tenant holds at most its share, and the fast tenant's events arrive while every slow
/// attempt still hangs. (Before the shares the slow tenant took all 8 slots, and the fast one
/// waited for the first timeout.)
#[tokio::test]
async fn one_tenants_slow_endpoints_leave_a_share_of_the_slots_to_another_tenant() {
    let (app, url) = spawn_app_on_own_database_with("fair_shares", |s| {
        delivering(s);
        s.webhooks.concurrency = 8;
        s.webhooks.timeout = Duration::from_secs(20);
    })
    .await;
    let slow = Receiver::start().await;
    slow.set_delay(Duration::from_secs(25));
    for _ in 0..10 {
        subscribe(&app, &slow, None).await;
    }
    for _ in 0..5 {
        pay(&app, 10).await;
    }
    wait_until(
        "the slow tenant's attempts under way",
        Duration::from_secs(20),
        || async { slow.in_flight() >= 4 },
    )
    .await;
    let (_, fast_key) = new_tenant(&app.pool, MissingKeyPolicy::Reject).await;
    let fast = Receiver::start().await;
    subscribe_as(&app, &fast_key, &fast, None).await;
    for _ in 0..5 {
        pay_as(&app, &fast_key).await;
    }
    fast.wait_for_acknowledged(5, Duration::from_secs(15)).await;
    assert!(
        slow.acknowledged().is_empty(),
        "a slow attempt ended: the test proves nothing"
    );
    assert!(
        slow.max_in_flight() <= 4,
        "the slow tenant held {} of 8 slots",
        slow.max_in_flight()
    );
    drop_database(&url).await;
}

/// Found from outside: a tenant's two endpoints that hang, created first, held the tenant's
/// whole share of the slots (the claim visits a tenant's endpoints oldest first), and its
/// healthy endpoint, created after them, got 10 of 313 events in 80 s. The share is now
/// split between the tenant's endpoints as the slots are between tenants: with 8 slots
/// (the tenant's share 4) the hanging two hold at most 3, and the healthy one's events
/// arrive while every hanging attempt still hangs. (Before: the first hanging endpoint took
/// all 4, and the healthy one waited for the 20 s timeout.)
#[tokio::test]
async fn a_tenants_hanging_endpoints_leave_a_share_of_its_slots_to_its_healthy_endpoint() {
    let (app, url) = spawn_app_on_own_database_with("endpoint_shares", |s| {
        delivering(s);
        s.webhooks.concurrency = 8;
        s.webhooks.timeout = Duration::from_secs(20);
    })
    .await;
    let hanging = Receiver::start().await;
    hanging.set_delay(Duration::from_secs(25));
    for _ in 0..2 {
        subscribe(&app, &hanging, None).await;
    }
    let healthy = Receiver::start().await;
    subscribe(&app, &healthy, None).await;
    for _ in 0..5 {
        pay(&app, 10).await;
    }
    healthy.wait_for_acknowledged(5, Duration::from_secs(15)).await;
    assert!(
        hanging.acknowledged().is_empty(),
        "a hanging attempt ended: the test proves nothing"
    );
    assert!(hanging.in_flight() >= 2, "both hanging endpoints are being tried");
    assert!(
        hanging.max_in_flight() <= 3,
        "the hanging endpoints held {} of the tenant's 4",
        hanging.max_in_flight()
    );
    drop_database(&url).await;
}

/// Found from outside: with more hanging endpoints than its share of the slots, a tenant's
/// endpoint created after them got 1 of 240 events in 60 s: the claim visited the tenant's
/// endpoints oldest first, and each freed slot went back to a hanging one. Healthy endpoints
/// now go first within the tenant (V45): here 6 hanging endpoints (a 1 s timeout) and a
/// healthy one created last share the tenant's 4 slots, and the healthy one's 10 events
/// arrive while the hanging ones are still being tried.
#[tokio::test]
async fn a_tenants_healthy_endpoint_gets_slots_before_more_hanging_siblings_than_its_share() {
    let (app, url) = spawn_app_on_own_database_with("endpoint_order", |s| {
        delivering(s);
        s.webhooks.concurrency = 8;
        s.webhooks.timeout = Duration::from_secs(1);
    })
    .await;
    let hanging = Receiver::start().await;
    hanging.set_delay(Duration::from_secs(30));
    for _ in 0..6 {
        subscribe(&app, &hanging, None).await;
    }
    let healthy = Receiver::start().await;
    subscribe(&app, &healthy, None).await;
    for _ in 0..10 {
        pay(&app, 10).await;
    }
    healthy.wait_for_acknowledged(10, Duration::from_secs(15)).await;
    assert!(hanging.acknowledged().is_empty(), "a hanging attempt answered");
    // (The receiver's own count of requests in flight keeps those oncepay gave up on after
    // its 1 s: the share's bound is the test above's.)
    // A healthy endpoint takes at most half the share while none is busy (V39): the other
    // half went to hanging ones.
    let tried: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT endpoint_id) FROM webhook_deliveries d JOIN webhook_endpoints e USING (tenant_id, endpoint_id)
          WHERE e.url = $1 AND d.attempts > 0",
    )
    .bind(hanging.url())
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(tried >= 2, "the hanging endpoints were tried meanwhile ({tried} of 6)");
    drop_database(&url).await;
}

/// Two replicas: a replayed creation answers the same body on both (the replay cache of the
/// one that answered first holds none of it), with the first answer's secret until the
/// secret is rotated, and `secret: null` after; a rotation's replay likewise shows its secret
/// until the next rotation.
#[tokio::test]
async fn a_replayed_creation_answers_alike_on_every_replica_and_never_with_a_later_secret() {
    let apps = TestApp::builder().spawn_instances(2).await;
    let (a, b) = (&apps[0], &apps[1]);
    let receiver = Receiver::start().await;
    let body = json!({ "url": receiver.url() });
    let key = new_key();
    let first = a.post("/webhook-endpoints", Some(&key), &body).await;
    assert_eq!(first.status, 201, "{}", first.body);
    let secret = first.body["secret"].as_str().unwrap().to_owned();
    let id = first.body["id"].as_str().unwrap().to_owned();
    for app in [a, b, a] {
        let replay = app.post("/webhook-endpoints", Some(&key), &body).await;
        assert_eq!((replay.status, replay.replayed()), (201, true));
        assert_eq!(replay.body, first.body);
    }
    let rotation_key = new_key();
    let rotate = format!("/webhook-endpoints/{id}/rotate-secret");
    let rotated = a.post(&rotate, Some(&rotation_key), &json!({})).await;
    assert_eq!(rotated.status, 200, "{}", rotated.body);
    let new_secret = rotated.body["secret"].as_str().unwrap().to_owned();
    assert_ne!(new_secret, secret);
    let mut expected = first.body.clone();
    expected["secret"] = serde_json::Value::Null;
    for app in [a, b] {
        let replay = app.post("/webhook-endpoints", Some(&key), &body).await;
        assert_eq!((replay.status, replay.replayed()), (201, true));
        assert_eq!(replay.body, expected, "a replay showed a secret it did not make");
        let replay = app.post(&rotate, Some(&rotation_key), &json!({})).await;
        assert_eq!(replay.body, rotated.body);
    }
    let again = b.post(&rotate, Some(&new_key()), &json!({})).await;
    assert_eq!(again.status, 200);
    for app in [a, b] {
        let replay = app.post(&rotate, Some(&rotation_key), &json!({})).await;
        assert_eq!((replay.status, replay.replayed()), (200, true));
        assert_eq!(replay.body["secret"], serde_json::Value::Null, "{}", replay.body);
        // Nor the later rotation's expiry as its own (found from outside: the replay showed
        // the second rotation's previous_secret_expires_at).
        assert_eq!(
            (&replay.body["previous_secret_expires_at"], &replay.body["id"]),
            (&serde_json::Value::Null, &rotated.body["id"]),
            "{}",
            replay.body
        );
    }
}

/// Found from outside (a 45-minute soak, two replicas): an event fanned out 13 ms before its
/// endpoint was disabled left its delivery `pending` with no attempt for ever, and
/// `oncepay_webhook_oldest_pending_seconds` grew a second a second. The fan-out's snapshot saw
/// the endpoint enabled, and the disable's UPDATE of the pending deliveries could not see the
/// fan-out's row before it committed. Reproduced here with the fan-out held open on a
/// connection of the test while one endpoint is deleted (the API) and another disabled (as
/// the deliverer disables a failing one); a deliverer then leaves the first delivery
/// cancelled and the second held (V37), and nothing reaches the receiver.
#[tokio::test]
async fn a_delivery_fanned_out_while_its_endpoint_is_deleted_or_disabled_does_not_stay_pending() {
    let (app, url) = crate::support::helpers::spawn_app_on_own_database("fan_out_race").await;
    let receiver = Receiver::start().await;
    let deleted = subscribe(&app, &receiver, None).await;
    let disabled = subscribe(&app, &receiver, None).await;
    pay(&app, 1).await;

    let mut fanning = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut fanning).await.unwrap();
    let fanned: Option<i32> = sqlx::query_scalar("SELECT oncepay_webhook_fan_out(1000)")
        .fetch_one(&mut fanning)
        .await
        .unwrap();
    assert_eq!(fanned, Some(1), "the payment's event fanned out, uncommitted");
    let gone = app
        .client
        .delete(app.url(&format!("/webhook-endpoints/{deleted}")))
        .bearer_auth(&app.api_key)
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 204);
    let mut disabler = sqlx::PgConnection::connect(&url).await.unwrap();
    let done: bool = sqlx::query_scalar("SELECT oncepay_webhook_disable($1, $2, 'failing')")
        .bind(app.tenant_id)
        .bind(Uuid::parse_str(&disabled).unwrap())
        .fetch_one(&mut disabler)
        .await
        .unwrap();
    assert!(done);
    sqlx::query("COMMIT").execute(&mut fanning).await.unwrap();

    let state = |endpoint: String| {
        let url = url.clone();
        async move {
            let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
            sqlx::query_scalar::<_, String>("SELECT state FROM webhook_deliveries WHERE endpoint_id = $1")
                .bind(Uuid::parse_str(&endpoint).unwrap())
                .fetch_one(&mut conn)
                .await
                .unwrap()
        }
    };
    assert_eq!(state(deleted.clone()).await, "pending", "the race, as the soak left it");
    assert_eq!(
        state(disabled.clone()).await,
        "pending",
        "the race, as the soak left it"
    );

    let settings = app.state.settings.clone();
    let _deliverer = TestApp::builder()
        .settings(|s| {
            *s = settings;
            delivering(s);
        })
        .tenant_of(&app)
        .spawn()
        .await;
    wait_until("the deleted endpoint's delivery cancelled", WAIT, || async {
        state(deleted.clone()).await == "cancelled"
    })
    .await;
    wait_until("the disabled endpoint's delivery held", WAIT, || async {
        state(disabled.clone()).await == "held"
    })
    .await;
    assert!(receiver.messages().is_empty(), "nothing delivered to either");
    crate::support::helpers::drop_database(&url).await;
}
