//! Webhooks against a real receiver of the tests' own (`support::webhook_receiver`), by
//! subject: `endpoints` (registration, listing, deletion, the URL guard, subscriptions),
//! `signing` (Standard Webhooks signatures, secrets with and without the encryption key,
//! rotation), `delivery` (every committed change's event arrives, signed, once acknowledged,
//! in order per resource, through every fault of a receiver), `outbox` (what the operations'
//! transactions write, late commits, fan-out, batches, retention), `planner` (the queue
//! tables' statements stay index lookups whatever the statistics saw), `schedule` (the retry
//! schedule's steps when an attempt is lost), and `hardening` (receivers and tenants as they
//! really behave). The kill -9 of a replica and the
//! PostgreSQL restart are in `make chaos` (tests/chaos/webhooks.rs). What the submodules
//! share is here.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;
use uuid::Uuid;

use crate::support::helpers::{new_key, TestApp};
use crate::support::webhook_receiver::Receiver;

mod delivery;
mod endpoints;
mod hardening;
mod outbox;
mod planner;
mod schedule;
mod signing;

pub(crate) const WAIT: Duration = Duration::from_secs(60);

/// Waits until `check` holds, polling every 50 ms; panics naming `what` after `timeout`.
pub(crate) async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + timeout;
    while !check().await {
        assert!(std::time::Instant::now() < deadline, "not within {timeout:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A replica that delivers webhooks.
pub(crate) fn delivering(settings: &mut oncepay::config::Settings) {
    settings.webhooks.concurrency = 16;
}

async fn delivering_app() -> TestApp {
    TestApp::builder().settings(delivering).spawn().await
}

/// Registers `receiver` for the app's tenant; gives the endpoint's id.
pub(crate) async fn subscribe(app: &TestApp, receiver: &Receiver, events: Option<&[&str]>) -> String {
    subscribe_as(app, &app.api_key, receiver, events).await
}

/// Registers `receiver` for the tenant of `api_key`; gives the endpoint's id.
pub(crate) async fn subscribe_as(app: &TestApp, api_key: &str, receiver: &Receiver, events: Option<&[&str]>) -> String {
    let mut body = json!({ "url": receiver.url() });
    if let Some(events) = events {
        body["events"] = json!(events);
    }
    let answer = app
        .post_as(api_key, "/webhook-endpoints", Some(&new_key()), &body)
        .await;
    assert_eq!(answer.status, 201, "{}", answer.body);
    receiver.set_secret(answer.body["secret"].as_str().unwrap());
    answer.body["id"].as_str().unwrap().to_owned()
}

/// The endpoints the app's tenant has stored, deleted ones included.
pub(crate) async fn endpoints_stored(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM webhook_endpoints WHERE tenant_id = $1")
        .bind(app.tenant_id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// Pays `amount` from `main`; the payment's id.
pub(crate) async fn pay(app: &TestApp, amount: i64) -> String {
    let answer = app.pay(Some(&new_key()), amount).await;
    assert_eq!(answer.status, 201, "{}", answer.body);
    answer.body["id"].as_str().unwrap().to_owned()
}

pub(crate) async fn refund(app: &TestApp, payment: &str) {
    let answer = app.refund(Some(&new_key()), payment).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
}

/// Every event the database holds for the tenant's committed changes, as `check` wants them:
/// each payment (and its refund), deposit and transfer.
pub(crate) async fn committed(app: &TestApp) -> BTreeMap<String, Vec<&'static str>> {
    let mut expected = BTreeMap::new();
    let payments: Vec<(Uuid, bool)> =
        sqlx::query_as("SELECT payment_id, refunded_at IS NOT NULL FROM payments WHERE tenant_id = $1")
            .bind(app.tenant_id)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    for (id, refunded) in payments {
        let types = if refunded {
            vec!["payment.succeeded", "payment.refunded"]
        } else {
            vec!["payment.succeeded"]
        };
        expected.insert(id.to_string(), types);
    }
    for (id,) in sqlx::query_as::<_, (Uuid,)>("SELECT deposit_id FROM deposits WHERE tenant_id = $1")
        .bind(app.tenant_id)
        .fetch_all(&app.pool)
        .await
        .unwrap()
    {
        expected.insert(id.to_string(), vec!["deposit.succeeded"]);
    }
    for (id,) in sqlx::query_as::<_, (Uuid,)>("SELECT transfer_id FROM transfers WHERE tenant_id = $1")
        .bind(app.tenant_id)
        .fetch_all(&app.pool)
        .await
        .unwrap()
    {
        expected.insert(id.to_string(), vec!["transfer.succeeded"]);
    }
    expected
}

fn event_count(expected: &BTreeMap<String, Vec<&str>>) -> usize {
    expected.values().map(Vec::len).sum()
}

/// Waits for every committed event of the app's tenant, then checks what arrived.
async fn all_delivered(app: &TestApp, receiver: &Receiver) -> crate::support::webhook_receiver::Report {
    let expected = committed(app).await;
    receiver.wait_for_acknowledged(event_count(&expected), WAIT).await;
    // Late duplicates have a moment to show up before the check.
    tokio::time::sleep(Duration::from_millis(300)).await;
    receiver.check(&expected)
}
