//! Rule 7 and the atomic claim: real concurrent requests, several servers on one database,
//! and transactions broken mid-flight.

use std::time::Duration;

use futures_util::future::join_all;
use serde_json::json;
use sqlx::Connection;

use crate::support::helpers::{direct_url, new_key, spawn_app, spawn_app_with, spawn_instances, TestApp, MAIN_BALANCE};

#[tokio::test]
async fn fifty_concurrent_requests_with_one_key_over_three_instances_charge_once() {
    let apps = spawn_instances(3).await;
    let key = new_key();

    let answers = join_all((0..50).map(|i| apps[i % 3].pay(Some(&key), 100))).await;

    let original = answers
        .iter()
        .find(|a| a.status == 201 && !a.replayed())
        .expect("one request was processed");
    assert_eq!(
        (&original.body["charged"], &original.body["balance"]),
        (&json!(100), &json!(MAIN_BALANCE - 100))
    );
    for answer in &answers {
        match answer.status {
            201 => assert_eq!(answer.body, original.body, "every 201 has an equal body"),
            409 => answer.assert_problem(409, "request_in_progress"),
            other => panic!("unexpected {other}: {}", answer.body),
        }
    }
    assert_eq!(answers.iter().filter(|a| a.status == 201 && !a.replayed()).count(), 1);
    assert_eq!(apps[0].balance("main").await, MAIN_BALANCE - 100, "exactly one debit");
    assert_eq!(apps[0].payment_count().await, 1, "exactly one payment row");
}

#[tokio::test]
async fn two_hundred_concurrent_distinct_keys_on_one_account_debit_two_hundred_times() {
    let apps = spawn_instances(2).await;

    let keys: Vec<String> = (0..200).map(|_| new_key()).collect();

    let answers = join_all(keys.iter().enumerate().map(|(i, key)| apps[i % 2].pay(Some(key), 10))).await;

    for answer in &answers {
        assert_eq!(answer.status, 201, "{}", answer.body);
    }
    assert_eq!(apps[0].balance("main").await, MAIN_BALANCE - 2_000);
    assert_eq!(apps[0].payment_count().await, 200);
    let mut balances: Vec<i64> = answers.iter().map(|a| a.body["balance"].as_i64().unwrap()).collect();
    balances.sort_unstable();
    balances.dedup();
    assert_eq!(balances.len(), 200, "each payment saw its own balance");
}

/// Holds the row lock of the tenant's `main` account in an open transaction, so that a
/// payment claims its key and then waits: a request "in flight" for as long as we like.
pub async fn lock_main_account(app: &TestApp) -> sqlx::PgConnection {
    lock_account(app, "main").await
}

/// Holds the row lock of one of the tenant's accounts in an open transaction.
pub async fn lock_account(app: &TestApp, account: &str) -> sqlx::PgConnection {
    lock_account_at(&direct_url(&app.state), app.tenant_id, account).await
}

/// [`lock_account`] on the database at `url`, for a tenant's account.
pub async fn lock_account_at(url: &str, tenant: uuid::Uuid, account: &str) -> sqlx::PgConnection {
    lock_accounts_at(url, &[(tenant, account)]).await
}

/// Holds the row locks of `rows` (tenant, account), taken in the order given, in one open
/// transaction on the database at `url`.
pub async fn lock_accounts_at(url: &str, rows: &[(uuid::Uuid, &str)]) -> sqlx::PgConnection {
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
    for (tenant, account) in rows {
        sqlx::query("SELECT 1 FROM accounts WHERE tenant_id = $1 AND account_id = $2 FOR UPDATE")
            .bind(tenant)
            .bind(account)
            .execute(&mut conn)
            .await
            .unwrap();
    }
    conn
}

/// A keyed payment of `amount` from `main`, sent in a task of its own (to wait behind a lock).
fn pay_in_background(app: &TestApp, key: &str, amount: i64) -> tokio::task::JoinHandle<reqwest::Response> {
    let (client, url, api_key, key) = (
        app.client.clone(),
        app.url("/payments"),
        app.api_key.clone(),
        key.to_owned(),
    );
    tokio::spawn(async move {
        client
            .post(url)
            .bearer_auth(api_key)
            .header("Idempotency-Key", key)
            .json(&json!({ "amount": amount }))
            .send()
            .await
            .unwrap()
    })
}

/// Waits (bounded) until a payment's backend is blocked by our lock; returns its pid. Only
/// backends that our own lock blocks count: other tests run at the same time.
pub async fn blocked_payment_backend(app: &TestApp, lock: &mut sqlx::PgConnection) -> i32 {
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *lock)
        .await
        .unwrap();
    for _ in 0..200 {
        let pid: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'oncepay' AND $1 = ANY(pg_blocking_pids(pid)) AND query LIKE '%oncepay_pay%' LIMIT 1",
        )
        .bind(holder)
        .fetch_optional(&app.pool)
        .await
        .unwrap();
        if let Some(pid) = pid {
            return pid;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no payment blocked on the account lock within 5 s");
}

#[tokio::test]
async fn a_duplicate_of_an_in_flight_request_waits_then_answers_409_with_retry_after() {
    let app = spawn_app_with(|s| s.inflight_wait = Duration::from_millis(300)).await;
    let key = new_key();
    let mut lock = lock_main_account(&app).await;
    let original = pay_in_background(&app, &key, 100);
    blocked_payment_backend(&app, &mut lock).await;

    let duplicate = app.pay(Some(&key), 100).await;

    duplicate.assert_problem(409, "request_in_progress");
    assert_eq!(duplicate.header("retry-after"), Some("1"));
    sqlx::query("ROLLBACK").execute(&mut lock).await.unwrap();
    let original = crate::support::helpers::Answer::from(original.await.unwrap()).await;
    assert_eq!(original.status, 201, "{}", original.body);
    let retry = app.pay(Some(&key), 100).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, original.body);
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
}

#[tokio::test]
async fn a_duplicate_that_outwaits_the_original_gets_its_result_not_a_second_charge() {
    let app = spawn_app().await;
    let key = new_key();
    let mut lock = lock_main_account(&app).await;
    let original = pay_in_background(&app, &key, 100);
    blocked_payment_backend(&app, &mut lock).await;
    let duplicate = pay_in_background(&app, &key, 100);
    tokio::time::sleep(Duration::from_millis(300)).await;

    sqlx::query("ROLLBACK").execute(&mut lock).await.unwrap();

    let original = crate::support::helpers::Answer::from(original.await.unwrap()).await;
    let duplicate = crate::support::helpers::Answer::from(duplicate.await.unwrap()).await;
    assert_eq!(original.status, 201);
    assert_eq!(duplicate.status, 201, "the duplicate waited on the index and replayed");
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, original.body);
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
}

#[tokio::test]
async fn a_transaction_broken_mid_flight_answers_503_commits_nothing_and_the_retry_charges_once() {
    let app = spawn_app().await;
    let key = new_key();
    let mut lock = lock_main_account(&app).await;
    let victim = pay_in_background(&app, &key, 100);
    let pid = blocked_payment_backend(&app, &mut lock).await;

    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut lock)
        .await
        .unwrap();
    assert!(terminated);
    let broken = crate::support::helpers::Answer::from(victim.await.unwrap()).await;
    sqlx::query("ROLLBACK").execute(&mut lock).await.unwrap();

    broken.assert_problem(503, "temporarily_unavailable");
    assert_eq!(broken.header("retry-after"), Some("1"));
    assert_eq!(app.key_count().await, 0, "the key is free again");
    assert_eq!(app.balance("main").await, MAIN_BALANCE, "nothing committed");
    let retry = app.pay(Some(&key), 100).await;
    assert_eq!(retry.status, 201, "{}", retry.body);
    assert!(!retry.replayed(), "the retry really ran");
    let again = app.pay(Some(&key), 100).await;
    assert!(again.replayed());
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100, "charged exactly once");
    assert_eq!(app.payment_count().await, 1);
}

#[tokio::test]
/// Keys live in the database, not in a server: a server started afresh (its own pool, no
/// replay cache of the first one) replays what another, whose pool is closed, committed.
/// (A real process killed and started again: tests/chaos/kill.rs.)
async fn a_fresh_server_replays_the_keys_of_one_whose_pool_is_closed() {
    let first = spawn_app().await;
    let key = new_key();
    let original = first.pay(Some(&key), 100).await;
    first.state.db.close().await;

    let second = TestApp::builder().tenant_of(&first).spawn().await;
    let replay = second.pay(Some(&key), 100).await;

    assert!(replay.replayed());
    assert_eq!(replay.body, original.body);
    assert_eq!(second.balance("main").await, MAIN_BALANCE - 100);
}

/// Found from outside: while a payment waited on its account's row, its key's lookup
/// answered 404 "no such resource", the answer for a key never used; a recovery tool that
/// took it so and paid again under a new key would charge twice. The row is committed only
/// with the payment, so the lookup asks the unique index (V40): 409 `request_in_progress`
/// with Retry-After while the payment runs, the payment once it is done. An unknown key is
/// still 404, and the lookup leaves nothing under it.
#[tokio::test]
async fn a_key_whose_payment_is_still_running_is_not_answered_as_never_used() {
    let app = spawn_app().await;
    let key = new_key();
    let mut lock = lock_main_account(&app).await;
    let payment = pay_in_background(&app, &key, 7);
    blocked_payment_backend(&app, &mut lock).await;
    let looked_up = app.get(&format!("/idempotency-keys/{key}")).await;
    looked_up.assert_problem(409, "request_in_progress");
    assert_eq!(looked_up.header("retry-after"), Some("1"));
    assert!(
        looked_up.body["detail"].as_str().unwrap().contains("look again"),
        "{}",
        looked_up.body
    );

    sqlx::query("COMMIT").execute(&mut lock).await.unwrap();
    assert_eq!(payment.await.unwrap().status(), 201);
    let done = app.get(&format!("/idempotency-keys/{key}")).await;
    assert_eq!((done.status, &done.body["status"]), (200, &json!(201)), "{}", done.body);

    let unused = new_key();
    assert_eq!(app.get(&format!("/idempotency-keys/{unused}")).await.status, 404);
    assert_eq!(app.get(&format!("/idempotency-keys/{unused}")).await.status, 404);
    let paid = app.post("/payments", Some(&unused), &json!({ "amount": 1 })).await;
    assert_eq!((paid.status, paid.replayed()), (201, false), "{}", paid.body);
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 8);
}
