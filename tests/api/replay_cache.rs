//! Replays from memory (`ONCEPAY_REPLAY_CACHE_ENTRIES`): the same answers as the database's,
//! never past the key's `expires_at`, per tenant, and nothing changes with the cache off.

use std::time::Duration;

use crate::support::helpers::{new_key, spawn_app, spawn_app_with, spawn_instances, TestApp, MAIN_BALANCE};

fn hits(app: &TestApp) -> u64 {
    app.state.metrics.replay_cache_hits.get()
}

fn misses(app: &TestApp) -> u64 {
    app.state.metrics.replay_cache_misses.get()
}

#[tokio::test]
async fn a_cached_replay_equals_the_databases_replay() {
    let apps = spawn_instances(2).await;
    let key = new_key();
    let first = apps[0].pay(Some(&key), 100).await;

    // Instance 1 never saw the key: it asks the database (and caches the answer).
    let from_database = apps[1].pay(Some(&key), 100).await;
    // Instance 0 finished it: it answers from memory.
    let hits_before = hits(&apps[0]);
    let from_memory = apps[0].pay(Some(&key), 100).await;

    assert_eq!(misses(&apps[1]), 1, "instance 1 asked the database");
    assert_eq!(hits(&apps[0]), hits_before + 1, "instance 0 answered from its cache");
    for answer in [&from_database, &from_memory] {
        assert_eq!(answer.status, 201);
        assert_eq!(answer.header("idempotency-replayed"), Some("true"));
        assert_eq!(answer.header("location"), first.header("location"));
        assert_eq!(answer.header("content-type"), Some("application/json"));
    }
    assert_eq!(from_memory.body, from_database.body, "equal JSON values");
    assert_eq!(from_memory.body, first.body);
    assert_eq!(apps[0].balance("main").await, MAIN_BALANCE - 100);
}

/// With the pool closed, a replay the process remembers answers all the same. Only while
/// the tenant is cached too (`auth::TENANT_CACHE_TTL`, 500 ms after its last look-up): past
/// that, authenticating any request needs the database, replay or not. The test checks that
/// its requests were made inside that time, so that a slow machine fails it loudly rather
/// than letting it pass for another reason.
#[tokio::test]
async fn a_cached_replay_needs_no_database_while_its_tenant_is_cached() {
    let app = spawn_app().await;
    let key = new_key();
    let first = app.pay(Some(&key), 100).await;
    let declined_key = new_key();
    app.pay(Some(&declined_key), MAIN_BALANCE + 1).await;

    // The tenant's cache entry lives from its look-up: let it expire, look it up afresh,
    // then close the pool at once.
    tokio::time::sleep(oncepay::auth::TENANT_CACHE_TTL + std::time::Duration::from_millis(100)).await;
    let cached_since = std::time::Instant::now();
    assert_eq!(app.get("/accounts/main").await.status, 200);
    app.state.db.close().await;
    let replay = app.pay(Some(&key), 100).await;
    let declined = app.pay(Some(&declined_key), MAIN_BALANCE + 1).await;
    let reused = app.pay(Some(&key), 999).await;
    let within = cached_since.elapsed();
    let fresh = app.pay(Some(&new_key()), 100).await;
    assert!(
        within < oncepay::auth::TENANT_CACHE_TTL,
        "the replays were made {within:?} after the tenant was cached, past its TTL: inconclusive"
    );

    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    declined.assert_problem(402, "insufficient_funds");
    assert_eq!(declined.header("idempotency-replayed"), Some("true"));
    reused.assert_problem(422, "idempotency_key_reused");
    fresh.assert_problem(503, "temporarily_unavailable");
}

#[tokio::test]
async fn a_cached_entry_never_outlives_the_keys_window() {
    let app = spawn_app_with(|s| s.replay_window = Duration::from_secs(1)).await;
    let key = new_key();
    app.pay(Some(&key), 100).await;
    assert!(app.pay(Some(&key), 100).await.replayed(), "inside the window: replayed");

    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let hits_before = hits(&app);
    let late = app.pay(Some(&key), 100).await;

    late.assert_problem(422, "idempotency_key_expired");
    assert_eq!(hits(&app), hits_before, "the expired entry was not served");
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
}

#[tokio::test]
async fn a_cached_derived_key_is_processed_anew_after_its_window() {
    let app = spawn_app_with(|s| s.fingerprint_window = Duration::from_secs(1)).await;
    app.set_policy("fingerprint").await;
    app.pay(None, 100).await;
    assert!(app.pay(None, 100).await.replayed());

    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let again = app.pay(None, 100).await;

    assert_eq!(again.status, 201);
    assert!(!again.replayed(), "a new window, a new payment");
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 200);
}

#[tokio::test]
async fn a_cached_key_with_another_body_is_refused() {
    let app = spawn_app().await;
    let key = new_key();
    app.pay(Some(&key), 100).await;
    let hits_before = hits(&app);

    let other = app.pay(Some(&key), 250).await;

    other.assert_problem(422, "idempotency_key_reused");
    assert_eq!(hits(&app), hits_before + 1, "refused from memory");
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
}

#[tokio::test]
async fn the_cache_keeps_tenants_apart() {
    let app = spawn_app().await;
    let (other_tenant, other_key) =
        crate::support::helpers::new_tenant(&app.pool, oncepay::domain::MissingKeyPolicy::Reject).await;
    let key = new_key();
    app.pay(Some(&key), 100).await;

    let theirs = app
        .post_as(
            &other_key,
            "/payments",
            Some(&key),
            &serde_json::json!({ "amount": 100 }),
        )
        .await;

    assert_eq!(theirs.status, 201);
    assert!(
        !theirs.replayed(),
        "the same key string in another tenant is another key"
    );
    assert_ne!(theirs.body["id"], serde_json::Value::Null);
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM payments WHERE tenant_id = $1")
        .bind(other_tenant)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(count, 1);
}

#[tokio::test]
async fn with_the_cache_off_replays_come_from_the_database_unchanged() {
    let app = spawn_app_with(|s| s.replay_cache_entries = 0).await;
    let key = new_key();
    let first = app.pay(Some(&key), 100).await;

    let replay = app.pay(Some(&key), 100).await;
    let reused = app.pay(Some(&key), 5).await;

    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    reused.assert_problem(422, "idempotency_key_reused");
    assert_eq!(hits(&app), 0);
    assert_eq!(app.state.replays.len(), 0);
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
}
