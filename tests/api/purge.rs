//! Rule 11: the purge, by endpoint, by function and on the in-process schedule. Tests that
//! count deletions exactly run on a database of their own: every purge deletes old rows of
//! every tenant, so parallel tests on the shared database would take each other's rows.

use std::time::{Duration, Instant};

use oncepay::db::Db;
use oncepay::purge::Retention;
use reqwest::Method;
use sqlx::PgPool;

use crate::support::helpers::{
    drop_database, empty_database, new_key, server_url, spawn_app, spawn_app_with, TestApp, MAIN_BALANCE,
};

const RETENTION: Retention = Retention {
    keys: Duration::from_secs(604_800),
    events: Duration::from_secs(30 * 86_400),
};

async fn backdate_keys(app: &TestApp, keys: &[String], age: &str) {
    sqlx::query(&format!(
        "UPDATE idempotency_keys SET created_at = now() - interval '{age}', expires_at = now() - interval '{age}' + interval '1 day' WHERE tenant_id = $1 AND key = ANY($2)"
    ))
    .bind(app.tenant_id)
    .bind(keys)
    .execute(&app.pool)
    .await
    .unwrap();
}

async fn remaining_keys(app: &TestApp, keys: &[String]) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE tenant_id = $1 AND key = ANY($2)")
        .bind(app.tenant_id)
        .bind(keys)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// A migrated database of the test's own.
async fn own_database(hint: &str) -> (String, PgPool) {
    let url = empty_database(hint).await;
    oncepay::db::migrate(&url).await.unwrap();
    let pool = PgPool::connect(&url).await.unwrap();
    (url, pool)
}

/// `n` key rows created `age` ago (and `young` rows created now), written directly.
async fn fill_keys(pool: &PgPool, n: i64, age: &str, young: i64) {
    sqlx::query(&format!(
        "INSERT INTO idempotency_keys (tenant_id, key, fingerprint, operation, method, path, status, resource_id, created_at, expires_at)
         SELECT gen_random_uuid(), 'k' || i, sha256(i::text::bytea), 'pay'::oncepay_operation, 'POST', '/payments', 201, gen_random_uuid()::text,
                CASE WHEN i <= $1 THEN now() - interval '{age}' ELSE now() END,
                CASE WHEN i <= $1 THEN now() - interval '{age}' ELSE now() END + interval '1 day'
           FROM generate_series(1, $1 + $2) i"
    ))
    .bind(n)
    .bind(young)
    .execute(pool)
    .await
    .unwrap();
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[tokio::test]
async fn the_purge_deletes_old_keys_keeps_young_ones_and_never_touches_payments() {
    let app = spawn_app().await;
    let old: Vec<String> = (0..5).map(|_| new_key()).collect();
    let young: Vec<String> = (0..3).map(|_| new_key()).collect();
    for key in old.iter().chain(&young) {
        assert_eq!(app.pay(Some(key), 10).await.status, 201);
    }
    backdate_keys(&app, &old, "8 days").await;

    let purged = app.admin(Method::POST, "/admin/purge", None).await;

    assert_eq!(purged.status, 200, "{}", purged.body);
    // Parallel tests' old keys may go in the same purge: at least these five.
    let deleted = purged.body["deleted"].as_u64().expect("`deleted` is a count");
    assert!(deleted >= 5, "deleted {deleted}");
    assert_eq!(remaining_keys(&app, &old).await, 0);
    assert_eq!(remaining_keys(&app, &young).await, 3);
    assert_eq!(app.payment_count().await, 8, "payments untouched");
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 80);
    let text = app.metrics().await;
    assert!(text.contains("oncepay_purge_runs_total 1"), "{text}");
    assert!(text.contains(&format!("oncepay_purged_keys_total {deleted}")), "{text}");
}

#[tokio::test]
async fn three_concurrent_purges_delete_each_row_once() {
    let (url, pool) = own_database("purge3").await;
    fill_keys(&pool, 1_000, "30 days", 100).await;

    let replicas: Vec<Db> = (0..3).map(|_| Db::beside(&pool)).collect();
    let counts =
        futures_util::future::join_all(replicas.iter().map(|db| oncepay::purge::purge(db, RETENTION, 7))).await;

    let counts: Vec<u64> = counts.into_iter().map(|c| c.unwrap().keys).collect();
    assert_eq!(
        counts.iter().sum::<u64>(),
        1_000,
        "the sum of the counts is the rows deleted: {counts:?}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        100,
        "young rows kept"
    );
    pool.close().await;
    drop_database(&url).await;
}

/// A purge run with a retention shorter than the window the keys were made with (say
/// `oncepay purge` started with another environment than the servers') must not delete a
/// key a retry may still replay: the retry would run again and charge twice.
#[tokio::test]
async fn a_key_inside_its_replay_window_is_kept_whatever_the_purges_retention() {
    let (url, pool) = own_database("purgewindow").await;
    fill_keys(&pool, 30, "8 days", 0).await;
    // Ten of the old rows were made with a window that has not ended yet.
    sqlx::query("UPDATE idempotency_keys SET expires_at = now() + interval '1 day' WHERE key IN (SELECT 'k' || i FROM generate_series(1, 10) i)")
        .execute(&pool)
        .await
        .unwrap();

    let deleted = oncepay::purge::purge(&Db::beside(&pool), RETENTION, 7)
        .await
        .unwrap()
        .keys;

    assert_eq!(deleted, 20, "only the rows past their window");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys WHERE expires_at > now()").await,
        10,
        "every key a retry may replay is kept"
    );
    pool.close().await;
    drop_database(&url).await;
}

/// A purge run with a shorter retention than a server of the database keeps keys for (say
/// `oncepay purge` with `ONCEPAY_RETENTION_SECS=60` beside servers keeping them 7 days) must
/// not delete keys past their window that the servers still refuse with 422: a retry would
/// run again and charge twice. The servers declare their retention (migrations/V32), and every
/// purge keeps keys for the longest one still in force.
#[tokio::test]
async fn a_key_is_kept_as_long_as_a_server_of_the_database_keeps_it_whatever_the_purges_retention() {
    let (url, pool) = own_database("purgekept").await;
    fill_keys(&pool, 30, "8 days", 0).await;
    // A server keeping keys 10 days declares it once it has reached its database.
    let app = spawn_app_with(|s| {
        s.database_url = url.clone();
        s.retention = Duration::from_secs(10 * 86_400);
    })
    .await;
    let mut declared = 0;
    for _ in 0..100 {
        declared = count(
            &pool,
            "SELECT count(*) FROM oncepay_key_retention WHERE retention_secs = 864000",
        )
        .await;
        if declared == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(declared, 1, "the server declared its retention");
    // A declaration whose keys are all older than it is no longer in force.
    sqlx::query("INSERT INTO oncepay_key_retention VALUES (3000000, now() - interval '40 days')")
        .execute(&pool)
        .await
        .unwrap();

    let short = Retention {
        keys: Duration::from_secs(60),
        ..RETENTION
    };
    let deleted = oncepay::purge::purge(&Db::beside(&pool), short, 7).await.unwrap().keys;
    assert_eq!(deleted, 0, "8-day-old keys are inside the server's 10 days");
    let deleted = app.admin(Method::POST, "/admin/purge", None).await;
    assert_eq!(deleted.body["deleted"], 0, "{}", deleted.body);

    // Once they are older than every retention in force, they go.
    sqlx::query("UPDATE idempotency_keys SET created_at = created_at - interval '3 days'")
        .execute(&pool)
        .await
        .unwrap();
    let deleted = oncepay::purge::purge(&Db::beside(&pool), short, 7).await.unwrap().keys;
    assert_eq!(deleted, 30);
    drop(app);
    pool.close().await;
    drop_database(&url).await;
}

#[tokio::test]
async fn a_purge_running_while_payments_flow_fails_none_of_them() {
    let (url, pool) = own_database("purgeload").await;
    fill_keys(&pool, 20_000, "10 days", 0).await;
    let app = spawn_app_with(|s| s.database_url = url.clone()).await;

    // Payments flow from before the purge starts until after it ends (bounded: 2,000).
    let purging = std::sync::atomic::AtomicBool::new(true);
    let started = Instant::now();
    let payments = async {
        let mut answers = Vec::new();
        let mut during = 0;
        while answers.len() < 2_000 && (purging.load(std::sync::atomic::Ordering::Acquire) || answers.len() < 20) {
            let keys: Vec<String> = (0..10).map(|_| new_key()).collect();
            let batch = futures_util::future::join_all(keys.iter().map(|k| app.pay(Some(k), 1))).await;
            if purging.load(std::sync::atomic::Ordering::Acquire) {
                during += batch.len();
            }
            answers.extend(batch);
        }
        (answers, during)
    };
    let db = Db::beside(&pool);
    let purge = async {
        let purged = oncepay::purge::purge(&db, RETENTION, 50).await;
        purging.store(false, std::sync::atomic::Ordering::Release);
        (purged, started.elapsed())
    };
    let ((answers, during), (purged, took)) = tokio::join!(payments, purge);

    assert_eq!(purged.unwrap().keys, 20_000);
    assert!(
        during >= 10,
        "payments were answered while the purge ran ({during} in {took:?})"
    );
    println!("{during} payments answered during a purge of 20,000 keys in 400 batches ({took:?})");
    for answer in &answers {
        assert_eq!(answer.status, 201, "{}", answer.body);
    }
    let paid = i64::try_from(answers.len()).unwrap();
    assert_eq!(app.balance("main").await, MAIN_BALANCE - paid);
    assert_eq!(app.key_count().await, paid, "the payments' own keys are young and kept");
    app.state.db.close().await;
    pool.close().await;
    drop_database(&url).await;
}

#[tokio::test]
async fn the_in_process_schedule_purges_everything_once_across_replicas() {
    let (url, pool) = own_database("purgesched").await;
    fill_keys(&pool, 2_000, "9 days", 10).await;

    let replicas = TestApp::builder()
        .settings(|s| {
            s.database_url = server_url(&url);
            s.purge_interval = Some(Duration::from_millis(200));
            s.purge_batch_size = 100;
        })
        .spawn_instances(2)
        .await;
    // A run counts its deletions once it has finished, after its last batch committed:
    // wait for the counters, not for the rows.
    let purged = || replicas.iter().map(|r| r.state.metrics.purged_keys.get()).sum::<u64>();
    let started = Instant::now();
    while purged() < 2_000 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the schedule did not purge within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A few more ticks of both schedules: nothing is counted twice.
    tokio::time::sleep(Duration::from_millis(500)).await;

    assert_eq!(
        purged(),
        2_000,
        "each row deleted once, by whichever replica held the lock"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        10,
        "the young keys stay"
    );
    for replica in &replicas {
        replica.state.db.close().await;
    }
    pool.close().await;
    drop_database(&url).await;
}

/// The schedule's lock is taken per batch, in the batch's transaction (so that it holds
/// through a transaction-mode pooler): while another session holds it, no replica purges.
#[tokio::test]
async fn no_scheduled_batch_runs_while_another_session_holds_the_purge_lock() {
    const SCHEDULE_LOCK: i64 = 0x0070_7572_6765; // src/purge.rs
    let (url, pool) = own_database("purgelock").await;
    fill_keys(&pool, 300, "9 days", 0).await;
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(SCHEDULE_LOCK)
        .execute(&mut *holder)
        .await
        .unwrap();
    let app = spawn_app_with(|s| {
        s.database_url = server_url(&url);
        s.purge_interval = Some(Duration::from_millis(100));
        s.purge_batch_size = 100;
    })
    .await;

    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(count(&pool, "SELECT count(*) FROM idempotency_keys").await, 300);
    assert_eq!(app.state.metrics.purged_keys.get(), 0, "no batch ran under the lock");
    assert_eq!(app.state.metrics.purge_runs.get(), 0);

    holder.rollback().await.unwrap();
    let started = Instant::now();
    while count(&pool, "SELECT count(*) FROM idempotency_keys").await > 0 || app.state.metrics.purged_keys.get() < 300 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the schedule did not purge within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(app.state.metrics.purged_keys.get(), 300);
    app.state.db.close().await;
    pool.close().await;
    drop_database(&url).await;
}
