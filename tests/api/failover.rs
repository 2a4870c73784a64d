//! What a failover looks like from one PostgreSQL (docs/ha.md): the database turns
//! read-only (a primary demoted to a standby: SQLSTATE 25006 read_only_sql_transaction) and
//! its sessions are terminated (57P01). oncepay answers 503 with `Retry-After`, never 500,
//! commits nothing, reports not ready, and recovers without a restart once writes work again.

use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::{Connection, Executor, PgConnection};

use crate::support::helpers::{
    client, database_url, drop_database, metric_value, new_key, spawn_app_on_own_database_with, Answer,
};

/// Runs `sql` from the test cluster's main test database (the scratch one turns read-only).
async fn admin(sql: &str) {
    let mut conn = PgConnection::connect(&database_url()).await.unwrap();
    conn.execute(sql).await.unwrap();
}

/// Ends every session on database `name` (57P01 on their next use), as a failover does: also
/// a pooler's server connections that never carried oncepay's application name (PgBouncer
/// opens one for a second concurrent query, such as an API key's last-use update).
async fn terminate_sessions(name: &str) {
    admin(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
              WHERE datname = '{name}' AND pid <> pg_backend_pid()"
    ))
    .await;
}

#[tokio::test]
async fn a_database_turned_read_only_answers_503_commits_nothing_and_the_pool_recovers() {
    let (app, url) = spawn_app_on_own_database_with("failover", |s| s.replay_cache_entries = 0).await;
    let name = url.rsplit('/').next().unwrap().to_owned();
    let (address, api_key, pool) = (app.address.clone(), app.api_key.clone(), app.pool.clone());
    let http = client();
    let pay = |key: String| {
        let request = http
            .post(format!("{address}/payments"))
            .bearer_auth(&api_key)
            .header("Idempotency-Key", key)
            .json(&json!({ "amount": 100 }));
        async move { Answer::from(request.send().await.unwrap()).await }
    };
    let readyz = || {
        let request = http.get(format!("{address}/readyz"));
        async move { request.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(pay(new_key()).await.status, 201, "a first payment warms the pool");
    // A key finished before the failover, replayed during it from the database (the server's
    // replay cache is off): a read-only node answers a replay, or 503, never 500.
    let finished = new_key();
    let original = pay(finished.clone()).await;
    assert_eq!(original.status, 201);
    assert_eq!(readyz().await, 200);
    let payments_before: i64 = sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(&pool)
        .await
        .unwrap();

    // The "failover": every new session is read-only, every pooled session is terminated.
    admin(&format!("ALTER DATABASE {name} SET default_transaction_read_only = on")).await;
    terminate_sessions(&name).await;

    let key = new_key();
    for attempt in 1..=12 {
        let answer = pay(key.clone()).await;
        answer.assert_problem(503, "temporarily_unavailable");
        assert_eq!(
            answer.header("retry-after"),
            Some("1"),
            "attempt {attempt}: 503 carries Retry-After"
        );
    }
    assert_eq!(readyz().await, 503, "not ready while the database cannot take writes");
    let replay = pay(finished.clone()).await;
    assert_eq!(
        (replay.status, replay.replayed(), &replay.body),
        (201, true, &original.body),
        "a replay needs no write (no synchronous standby to wait for)"
    );
    let metrics = app.metrics().await;
    assert_eq!(
        metric_value(&metrics, "oncepay_ready"),
        0.0,
        "the scrape says what /readyz says (found from outside: 1 beside 503)"
    );
    assert!(
        metric_value(&metrics, r#"oncepay_db_connections_closed_total{reason="broken"}"#) >= 1.0,
        "the terminated and read-only connections were closed, and counted:\n{metrics}"
    );

    let mut check = PgConnection::connect(&url).await.unwrap();
    let payments_during: i64 = sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(&mut check)
        .await
        .unwrap();
    let key_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key = $1")
        .bind(&key)
        .fetch_one(&mut check)
        .await
        .unwrap();
    assert_eq!(payments_during, payments_before, "nothing committed while read-only");
    assert_eq!(key_rows, 0, "the key stays free: no stored result to replay");

    // Writable again: the same server, the same key, without a restart. Read-only pooled
    // sessions were closed on their 25006, so the pool reconnects to a writable database.
    admin(&format!("ALTER DATABASE {name} RESET default_transaction_read_only")).await;
    let recovered = Instant::now();
    let first = loop {
        let answer = pay(key.clone()).await;
        if answer.status == 201 {
            break answer;
        }
        answer.assert_problem(503, "temporarily_unavailable");
        assert!(
            recovered.elapsed() < Duration::from_secs(10),
            "the pool did not recover within 10 s"
        );
    };
    assert!(!first.replayed());
    let again = pay(key.clone()).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed(), "the retry replays the one payment");
    assert_eq!(again.body["id"], first.body["id"]);
    assert_eq!(readyz().await, 200, "ready again");
    assert_eq!(
        metric_value(&app.metrics().await, "oncepay_ready"),
        1.0,
        "and so says the scrape"
    );
    let with_key: i64 = sqlx::query_scalar("SELECT count(*) FROM payments WHERE idempotency_key = $1")
        .bind(&key)
        .fetch_one(&mut check)
        .await
        .unwrap();
    assert_eq!(with_key, 1, "one payment for the key");
    drop(check);
    app.state.db.close().await;
    pool.close().await;
    drop_database(&url).await;
}
