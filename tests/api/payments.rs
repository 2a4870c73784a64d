//! Contract section 5, rules 4, 5, 6, 8 and 9, one test each, through the payment endpoints.

use chrono::{DateTime, Utc};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::helpers::{assert_v7_between, new_key, spawn_app, spawn_app_with, TestApp, MAIN_BALANCE};

/// A payment's `created_at` and `refunded_at` as stored.
pub async fn stored_times(app: &TestApp, id: Uuid) -> (DateTime<Utc>, Option<DateTime<Utc>>) {
    sqlx::query_as("SELECT created_at, refunded_at FROM payments WHERE tenant_id = $1 AND payment_id = $2")
        .bind(app.tenant_id)
        .bind(id)
        .fetch_one(&app.pool)
        .await
        .expect("the payment is stored")
}

/// A JSON timestamp (RFC 3339).
fn timestamp(value: &Value) -> DateTime<Utc> {
    serde_json::from_value(value.clone()).unwrap_or_else(|_| panic!("not a timestamp: {value}"))
}

#[tokio::test]
async fn a_new_payment_is_charged_once_and_answered_201_with_its_location() {
    let app = spawn_app().await;
    let key = new_key();

    let answer = app.pay(Some(&key), 100).await;

    assert_eq!(answer.status, 201, "{}", answer.body);
    assert!(!answer.replayed());
    let id = answer.body["id"].as_str().unwrap();
    assert_eq!(answer.header("location"), Some(format!("/payments/{id}").as_str()));
    assert_eq!(answer.body["account"], "main");
    assert_eq!(answer.body["charged"], 100);
    assert_eq!(answer.body["balance"], MAIN_BALANCE - 100);
    assert_eq!(answer.body["status"], "succeeded");
    let (created_at, refunded_at) = stored_times(&app, id.parse().unwrap()).await;
    assert_eq!(timestamp(&answer.body["created_at"]), created_at);
    assert_eq!(refunded_at, None);
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
    // Rule 4: the key row keeps the result (status, resource id) and no body.
    let (status, resource, method, path): (i16, String, String, String) = sqlx::query_as(
        "SELECT status, resource_id, method, path FROM idempotency_keys WHERE tenant_id = $1 AND key = $2",
    )
    .bind(app.tenant_id)
    .bind(&key)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        (status, resource.as_str(), method.as_str(), path.as_str()),
        (201, id, "POST", "/payments")
    );
}

#[tokio::test]
async fn a_new_payments_id_is_a_uuid7_of_the_time_it_was_made() {
    let app = spawn_app().await;
    let before = Utc::now().timestamp_millis();

    let answer = app.pay(Some(&new_key()), 100).await;

    let after = Utc::now().timestamp_millis();
    assert_eq!(answer.status, 201, "{}", answer.body);
    let id: Uuid = answer.body["id"].as_str().unwrap().parse().unwrap();
    assert_v7_between(id, before, after);
}

#[tokio::test]
async fn the_key_row_expires_one_replay_window_after_it_was_created() {
    let app = spawn_app().await;
    let key = new_key();
    app.pay(Some(&key), 100).await;

    let lifetime: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM expires_at - created_at)::float8 FROM idempotency_keys WHERE tenant_id = $1 AND key = $2",
    )
    .bind(app.tenant_id)
    .bind(&key)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(lifetime, 86_400.0, "the default ONCEPAY_REPLAY_WINDOW_SECS");
}

#[tokio::test]
async fn replaying_a_key_returns_the_first_answer_and_charges_nothing() {
    let app = spawn_app().await;
    let key = new_key();
    let first = app.pay(Some(&key), 100).await;

    let second = app.pay(Some(&key), 100).await;

    assert_eq!(second.status, 201);
    assert!(second.replayed(), "a replay says so");
    assert_eq!(second.body, first.body);
    assert_eq!(second.header("location"), first.header("location"));
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
    assert_eq!(app.payment_count().await, 1);
}

#[tokio::test]
async fn replaying_after_later_payments_and_a_refund_returns_the_first_balance() {
    let app = spawn_app().await;
    let key = new_key();
    let first = app.pay(Some(&key), 100).await;
    app.pay(Some(&new_key()), 250).await;
    let id = first.body["id"].as_str().unwrap().to_owned();
    let refund = app.refund(Some(&new_key()), &id).await;
    assert_eq!(refund.status, 200, "{}", refund.body);

    let replay = app.pay(Some(&key), 100).await;

    assert!(replay.replayed());
    assert_eq!(replay.body, first.body, "the replay is that request's result");
    assert_eq!(replay.body["status"], "succeeded");
    assert_eq!(replay.body["balance"], MAIN_BALANCE - 100);
    // ...while GET shows the current state.
    let current = app.get(&format!("/payments/{id}")).await;
    assert_eq!(current.status, 200);
    assert_eq!(current.body["status"], "refunded");
    let (_, refunded_at) = stored_times(&app, id.parse().unwrap()).await;
    assert_eq!(Some(timestamp(&current.body["refunded_at"])), refunded_at);
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 250);
}

#[tokio::test]
async fn the_same_key_with_a_different_body_is_refused_with_422_and_processes_nothing() {
    let app = spawn_app().await;
    let key = new_key();
    app.pay(Some(&key), 100).await;

    let reused = app.pay(Some(&key), 99_999).await;

    reused.assert_problem(422, "idempotency_key_reused");
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
    assert_eq!(app.payment_count().await, 1);
}

#[tokio::test]
async fn the_same_key_on_another_path_is_refused_with_422() {
    let app = spawn_app().await;
    let key = new_key();
    app.pay(Some(&key), 100).await;

    let other = app
        .post("/accounts/main/deposits", Some(&key), &json!({ "amount": 100 }))
        .await;

    other.assert_problem(422, "idempotency_key_reused");
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
}

#[tokio::test]
async fn bodies_equal_as_json_values_are_the_same_request() {
    let app = spawn_app().await;
    let key = new_key();
    let first = app
        .post("/payments", Some(&key), &json!({ "amount": 100, "account": "main" }))
        .await;

    let respelled = app
        .client
        .post(app.url("/payments"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", &key)
        .header("Content-Type", "application/json")
        .body("{ \"account\" : \"m\\u0061in\",\n \"amount\": 100 }")
        .send()
        .await
        .unwrap();
    let second = crate::support::helpers::Answer::from(respelled).await;

    assert!(second.replayed(), "{}", second.body);
    assert_eq!(second.body, first.body);
}

#[tokio::test]
async fn pay_is_an_alias_of_payments_with_the_same_fingerprint() {
    let app = spawn_app().await;
    let key = new_key();
    let first = app.post("/pay", Some(&key), &json!({ "amount": 100 })).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body["charged"], 100);

    let second = app.pay(Some(&key), 100).await;

    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
}

#[tokio::test]
async fn a_declined_payment_is_stored_and_replayed_even_after_a_deposit() {
    let app = spawn_app().await;
    let key = new_key();
    let declined = app.pay(Some(&key), MAIN_BALANCE + 1).await;
    declined.assert_problem(402, "insufficient_funds");
    assert!(!declined.replayed());
    let deposit = app
        .post("/accounts/main/deposits", Some(&new_key()), &json!({ "amount": 5000 }))
        .await;
    assert_eq!(deposit.status, 201);

    let replay = app.pay(Some(&key), MAIN_BALANCE + 1).await;

    replay.assert_problem(402, "insufficient_funds");
    assert!(replay.replayed());
    assert_eq!(replay.body["type"], declined.body["type"]);
    assert_eq!(replay.body["title"], declined.body["title"]);
    assert_eq!(app.balance("main").await, MAIN_BALANCE + 5000);
    assert_eq!(app.payment_count().await, 0);
}

#[tokio::test]
async fn a_payment_from_an_unknown_account_is_a_stored_404() {
    let app = spawn_app().await;
    let key = new_key();
    let first = app
        .post("/payments", Some(&key), &json!({ "amount": 1, "account": "ghost" }))
        .await;
    first.assert_problem(404, "account_not_found");
    app.open_account("ghost", 500).await;

    let replay = app
        .post("/payments", Some(&key), &json!({ "amount": 1, "account": "ghost" }))
        .await;

    replay.assert_problem(404, "account_not_found");
    assert!(replay.replayed());
    assert_eq!(app.balance("ghost").await, 500);
}

#[tokio::test]
async fn a_key_past_its_replay_window_is_refused_whatever_the_body() {
    // The test ages the key row behind the server's back, which its replay cache (trusting
    // the stored expiry, which never moves in real life) would not see: the database decides.
    let app = spawn_app_with(|s| s.replay_cache_entries = 0).await;
    let key = new_key();
    app.pay(Some(&key), 100).await;
    sqlx::query(
        "UPDATE idempotency_keys SET created_at = now() - interval '1 day 1 second', expires_at = now() - interval '1 second' WHERE tenant_id = $1 AND key = $2",
    )
    .bind(app.tenant_id)
    .bind(&key)
    .execute(&app.pool)
    .await
    .unwrap();

    let same = app.pay(Some(&key), 100).await;
    let other = app.pay(Some(&key), 7).await;

    same.assert_problem(422, "idempotency_key_expired");
    other.assert_problem(422, "idempotency_key_expired");
    assert!(same.body["detail"].as_str().unwrap().contains("new key"));
    assert_eq!(
        app.balance("main").await,
        MAIN_BALANCE - 100,
        "never silently re-processed"
    );
}

#[tokio::test]
async fn a_refund_credits_once_and_a_second_refund_is_a_stored_409() {
    let app = spawn_app().await;
    let paid = app.pay(Some(&new_key()), 300).await;
    let path = format!("/payments/{}/refund", paid.body["id"].as_str().unwrap());
    let key = new_key();

    let refund = app.post(&path, Some(&key), &json!({})).await;
    let replay = app.post(&path, Some(&key), &json!({})).await;
    let again = app.post(&path, Some(&new_key()), &json!({})).await;

    assert_eq!(refund.status, 200, "{}", refund.body);
    assert_eq!(refund.body["status"], "refunded");
    assert_eq!(refund.body["refunded"], 300);
    assert_eq!(refund.body["balance"], MAIN_BALANCE);
    assert!(replay.replayed());
    assert_eq!(replay.body, refund.body);
    again.assert_problem(409, "already_refunded");
    assert_eq!(app.balance("main").await, MAIN_BALANCE);
}

#[tokio::test]
async fn a_refund_accepts_an_empty_body() {
    let app = spawn_app().await;
    let paid = app.pay(Some(&new_key()), 300).await;
    let url = app.url(&format!("/payments/{}/refund", paid.body["id"].as_str().unwrap()));

    let response = app
        .client
        .post(url)
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", new_key())
        .send()
        .await
        .unwrap();

    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(app.balance("main").await, MAIN_BALANCE);
}

#[tokio::test]
async fn accounts_and_deposits_are_idempotent_too() {
    let app = spawn_app().await;
    let key = new_key();
    let created = app
        .post("/accounts", Some(&key), &json!({ "id": "u1", "balance": 700 }))
        .await;
    let replay = app
        .post("/accounts", Some(&key), &json!({ "id": "u1", "balance": 700 }))
        .await;
    let duplicate = app.post("/accounts", Some(&new_key()), &json!({ "id": "u1" })).await;
    assert_eq!(created.status, 201, "{}", created.body);
    assert_eq!(created.body["id"], "u1");
    assert_eq!(created.body["balance"], 700);
    assert!(replay.replayed());
    assert_eq!(replay.body, created.body);
    duplicate.assert_problem(409, "account_exists");

    let deposit_key = new_key();
    let deposit = app
        .post("/accounts/u1/deposits", Some(&deposit_key), &json!({ "amount": 50 }))
        .await;
    app.post("/accounts/u1/deposits", Some(&new_key()), &json!({ "amount": 1 }))
        .await;
    let deposit_replay = app
        .post("/accounts/u1/deposits", Some(&deposit_key), &json!({ "amount": 50 }))
        .await;
    assert_eq!(deposit.status, 201);
    assert_eq!(deposit.body["account"], "u1");
    assert_eq!(deposit.body["amount"], 50);
    assert_eq!(deposit.body["balance"], 750);
    assert_eq!(deposit_replay.body, deposit.body);
    assert!(deposit_replay.replayed());

    let account = app.get("/accounts/u1").await;
    assert_eq!(account.status, 200);
    assert_eq!(
        account.body,
        json!({ "id": "u1", "balance": 751, "created_at": created.body["created_at"] })
    );
    let missing = app
        .post("/accounts/nobody/deposits", Some(&new_key()), &json!({ "amount": 1 }))
        .await;
    missing.assert_problem(404, "account_not_found");
    app.get("/accounts/nobody")
        .await
        .assert_problem(404, "account_not_found");
}
