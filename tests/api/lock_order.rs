//! One lock order everywhere: (tenant, account) compared as bytes, in batches (src/batch.rs)
//! and in transfers (`oncepay_transfer`, `COLLATE "C"`), on a database whose own collation is
//! not byte order (ICU `en-US`, where `a` < `B`; in bytes `B` < `a`).
//!
//! Each test runs on an ICU database of its own, so that its `pg_stat_database.deadlocks`
//! counts only its own transactions. The first two build, with row locks the test holds,
//! interleavings where the old orders were opposite: two batches on two replicas taking two
//! tenants' `main` rows (the order was the account id alone, ties broken by the clients'
//! keys; with that order restored this test saw PostgreSQL break one deadlock), and a batch
//! and a transfer taking `a` and `B` (bytes in Rust, the collation in SQL; with the old
//! orders restored this interleaving did not deadlock in one run, so it guards the answer,
//! not the cause). The third is the same under load, with keys whose prefixes alternate
//! below and above one another (a tenant provoking stalls on purpose).

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use oncepay::domain::MissingKeyPolicy;
use serde_json::json;
use sqlx::{Connection, Executor, PgConnection, PgPool};
use uuid::Uuid;

use crate::batch::pay_on;
use crate::concurrency::lock_accounts_at;
use crate::support::helpers::{
    database_url, drop_database, new_key, new_tenant, server_url, waiting_behind, Answer, TestApp,
};

/// A migrated database whose default collation is ICU `en-US`; its direct URL.
async fn icu_database() -> String {
    let name = format!("oncepay_icu_{}", Uuid::new_v4().simple());
    let mut conn = PgConnection::connect(&database_url()).await.unwrap();
    conn.execute(format!("CREATE DATABASE {name} LOCALE_PROVIDER icu ICU_LOCALE 'en-US' TEMPLATE template0").as_str())
        .await
        .unwrap();
    let base = database_url().rsplit_once('/').unwrap().0.to_owned();
    let url = format!("{base}/{name}");
    oncepay::db::migrate(&url).await.unwrap();
    let mut conn = PgConnection::connect(&url).await.unwrap();
    let ordered: bool = sqlx::query_scalar("SELECT 'a' < 'B'")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(ordered, "the database sorts by ICU en-US, not by bytes");
    url
}

/// The deadlocks PostgreSQL broke in the database at `url`. A backend reports its counts
/// within a second of going idle, so this waits two first.
async fn deadlocks(url: &str) -> i64 {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let name = url.rsplit('/').next().unwrap();
    let mut conn = PgConnection::connect(&database_url()).await.unwrap();
    sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = $1")
        .bind(name)
        .fetch_one(&mut conn)
        .await
        .unwrap()
}

/// Replicas on `url` with one batch slot each, so that what queues behind a held slot
/// leaves in one statement.
async fn replicas(url: &str, n: usize) -> Vec<TestApp> {
    TestApp::builder()
        .settings(|s| {
            s.database_url = server_url(url);
            s.db_batches_in_flight = Some(1);
            s.db_batch_max = 32;
        })
        .spawn_instances(n)
        .await
}

async fn open(pool: &PgPool, tenant: Uuid, account: &str, balance: i64) {
    sqlx::query(
        "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance) VALUES ($1, $2, $3, $3)
         ON CONFLICT (tenant_id, account_id) DO UPDATE SET balance = EXCLUDED.balance",
    )
    .bind(tenant)
    .bind(account)
    .bind(balance)
    .execute(pool)
    .await
    .unwrap();
}

/// A transaction holding the rows of `rows` (tenant, account) until it is committed.
async fn hold(url: &str, rows: &[(Uuid, &str)]) -> (PgConnection, i32) {
    let mut conn = lock_accounts_at(url, rows).await;
    let pid = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    (conn, pid)
}

/// Waits (bounded) until `n` of the servers' backends wait for the lock of `holder`.
async fn blocked_by(pool: &PgPool, holder: i32, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let blocked = waiting_behind(pool, holder).await;
        if blocked >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{blocked} of {n} statements blocked on our lock after 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn pay(app: &TestApp, api_key: &str, key: String, account: &str) -> Answer {
    app.post_as(
        api_key,
        "/payments",
        Some(&key),
        &json!({"amount": 1, "account": account}),
    )
    .await
}

/// Two tenants, `low` < `high` as bytes (the order both batches must take them in).
async fn two_tenants(pool: &PgPool) -> ((Uuid, String), (Uuid, String)) {
    let a = new_tenant(pool, MissingKeyPolicy::Reject).await;
    let b = new_tenant(pool, MissingKeyPolicy::Reject).await;
    if a.0 < b.0 {
        (a, b)
    } else {
        (b, a)
    }
}

#[tokio::test]
async fn two_batches_on_two_replicas_take_two_tenants_rows_in_one_order() {
    let url = icu_database().await;
    let apps = replicas(&url, 2).await;
    let pool = PgPool::connect(&url).await.unwrap();
    let ((low, low_key), (high, high_key)) = two_tenants(&pool).await;
    open(&pool, apps[0].tenant_id, "blocker", 100).await;
    let blocker_key = apps[0].api_key.clone();

    // Each replica's one slot: a payment blocked on a row we hold.
    let (mut slots, slots_pid) = hold(&url, &[(apps[0].tenant_id, "blocker")]).await;
    // The two `main` rows, held until both batches wait on them.
    let (mut mains, mains_pid) = hold(&url, &[(low, "main"), (high, "main")]).await;
    let first: Vec<_> = apps
        .iter()
        .map(|app| {
            let (app, blocker_key) = (app.clone(), blocker_key.clone());
            tokio::spawn(async move { pay(&app, &blocker_key, Uuid::new_v4().to_string(), "blocker").await })
        })
        .collect();
    blocked_by(&pool, slots_pid, 2).await;

    // Before, a batch ran its items by account, then by key: replica 0's batch took `low`
    // first (its key sorts first), replica 1's `high` first.
    let queued: Vec<_> = [("0", "z"), ("z", "0")]
        .into_iter()
        .zip(&apps)
        .map(|((low_prefix, high_prefix), app)| {
            let app = app.clone();
            let (low_key, high_key) = (low_key.clone(), high_key.clone());
            let (k1, k2) = (
                format!("{low_prefix}-{}", Uuid::new_v4()),
                format!("{high_prefix}-{}", Uuid::new_v4()),
            );
            tokio::spawn(
                async move { join_all([pay(&app, &low_key, k1, "main"), pay(&app, &high_key, k2, "main")]).await },
            )
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    sqlx::query("COMMIT").execute(&mut slots).await.unwrap();
    for answer in join_all(first).await {
        assert_eq!(answer.unwrap().status, 201);
    }
    // Both batches are out, each waiting for the first `main` row it locks.
    blocked_by(&pool, mains_pid, 2).await;
    sqlx::query("COMMIT").execute(&mut mains).await.unwrap();
    for answers in join_all(queued).await {
        for answer in answers.unwrap() {
            assert_eq!(answer.status, 201, "{}", answer.body);
        }
    }
    drop(apps);
    pool.close().await;
    assert_eq!(deadlocks(&url).await, 0, "PostgreSQL broke no deadlock");
    drop_database(&url).await;
}

#[tokio::test]
async fn a_batch_and_a_transfer_take_two_accounts_in_one_order_whatever_the_collation() {
    let url = icu_database().await;
    let apps = replicas(&url, 2).await;
    let pool = PgPool::connect(&url).await.unwrap();
    let tenant = apps[0].tenant_id;
    for account in ["a", "B", "blocker"] {
        open(&pool, tenant, account, 1_000).await;
    }
    let (mut slot, slot_pid) = hold(&url, &[(tenant, "blocker")]).await;
    let (mut rows, rows_pid) = hold(&url, &[(tenant, "a"), (tenant, "B")]).await;
    let first = {
        let app = apps[0].clone();
        tokio::spawn(async move { pay_on(&app, &new_key(), "blocker", 1).await })
    };
    blocked_by(&pool, slot_pid, 1).await;
    // Replica 0: a batch of a payment on `a` and one on `B` (bytes: `B` first).
    let batch = {
        let app = apps[0].clone();
        tokio::spawn(
            async move { join_all([pay_on(&app, &new_key(), "a", 1), pay_on(&app, &new_key(), "B", 1)]).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    sqlx::query("COMMIT").execute(&mut slot).await.unwrap();
    assert_eq!(first.await.unwrap().status, 201);
    // Replica 1: a transfer from `a` to `B` (before, in the collation's order: `a` first).
    let transfer = {
        let app = apps[1].clone();
        tokio::spawn(async move { app.transfer(Some(&Uuid::new_v4().to_string()), "a", "B", 5).await })
    };
    blocked_by(&pool, rows_pid, 2).await;
    sqlx::query("COMMIT").execute(&mut rows).await.unwrap();
    for answer in batch.await.unwrap() {
        assert_eq!(answer.status, 201, "{}", answer.body);
    }
    let transfer = transfer.await.unwrap();
    assert_eq!(transfer.status, 201, "{}", transfer.body);
    drop(apps);
    pool.close().await;
    assert_eq!(deadlocks(&url).await, 0, "PostgreSQL broke no deadlock");
    drop_database(&url).await;
}

#[tokio::test]
async fn many_tenants_paying_and_transferring_both_ways_on_three_replicas_never_deadlock() {
    const TENANTS: usize = 6;
    const CLIENTS: usize = 48;
    const EACH: usize = 25;
    let url = icu_database().await;
    let apps = TestApp::builder()
        .settings(|s| {
            s.database_url = server_url(&url);
            s.db_batches_in_flight = Some(2);
        })
        .spawn_instances(3)
        .await;
    let pool = PgPool::connect(&url).await.unwrap();
    let mut tenants = Vec::new();
    for _ in 0..TENANTS {
        let (tenant, key) = new_tenant(&pool, MissingKeyPolicy::Reject).await;
        for account in ["a", "B", "c", "Z"] {
            open(&pool, tenant, account, 1_000_000).await;
        }
        tenants.push(key);
    }
    let accounts = ["a", "B", "c", "Z", "main"];
    let started = Instant::now();
    let clients = (0..CLIENTS).map(|client| {
        let apps: Vec<TestApp> = apps.iter().map(TestApp::clone).collect();
        let tenants = tenants.clone();
        tokio::spawn(async move {
            let mut statuses = Vec::with_capacity(EACH);
            for i in 0..EACH {
                let n = client * EACH + i;
                let app = &apps[n % apps.len()];
                let api_key = &tenants[(n / 3) % tenants.len()];
                // Keys whose prefixes alternate below and above every other's.
                let key = format!("{}-{}", if n.is_multiple_of(2) { "0" } else { "~" }, Uuid::new_v4());
                let (from, to) = (accounts[n % 5], accounts[(n / 5 + 1 + n) % 5]);
                let answer = if n % 4 == 3 && from != to {
                    let body = json!({"from": from, "to": to, "amount": 1});
                    app.post_as(api_key, "/transfers", Some(&key), &body).await
                } else {
                    pay(app, api_key, key, from).await
                };
                statuses.push((answer.status, answer.body.to_string()));
            }
            statuses
        })
    });
    let mut answered = 0;
    for statuses in join_all(clients).await {
        for (status, body) in statuses.unwrap() {
            assert!(status < 500, "a {status}: {body}");
            assert_eq!(status, 201, "{body}");
            answered += 1;
        }
    }
    assert_eq!(answered, CLIENTS * EACH);
    println!("{answered} payments and transfers in {:?}", started.elapsed());
    drop(apps);
    pool.close().await;
    assert_eq!(deadlocks(&url).await, 0, "PostgreSQL broke no deadlock");
    drop_database(&url).await;
}
