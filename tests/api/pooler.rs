//! `ONCEPAY_DB_POOLER=transaction` (docs/scaling.md, a connection pooler): what mode `none`
//! puts in the start-up packet holds per transaction instead, and no prepared statement
//! outlives its call. `make test` runs these against PostgreSQL itself, `make test-pgbouncer`
//! through PgBouncer.

use std::time::{Duration, Instant};

use oncepay::config::Pooler;
use oncepay::db::Db;
use sqlx::{Executor, PgConnection, Row};

use crate::concurrency::lock_main_account;
use crate::support::helpers::{new_key, spawn_app_with, test_settings, MAIN_BALANCE};

#[tokio::test]
async fn in_transaction_mode_the_statement_timeout_still_bounds_a_payment() {
    let app = spawn_app_with(|s| {
        s.db_pooler = Pooler::Transaction;
        s.inflight_wait = Duration::from_millis(100);
        s.statement_timeout = Duration::from_millis(700);
    })
    .await;
    let mut lock = lock_main_account(&app).await;

    let started = Instant::now();
    let answer = app.pay(Some(&new_key()), 100).await;
    let waited = started.elapsed();
    sqlx::query("ROLLBACK").execute(&mut lock).await.unwrap();

    answer.assert_problem(503, "temporarily_unavailable");
    assert!(
        waited >= Duration::from_millis(600) && waited < Duration::from_secs(5),
        "the payment waited {waited:?} on the account lock, not the 700 ms statement timeout"
    );
    assert_eq!(app.balance("main").await, MAIN_BALANCE, "nothing was charged");
}

/// Prepared statements left on the (possibly pooled) server connection, read with the
/// simple protocol so that the check itself prepares nothing.
async fn prepared_statements(c: &mut PgConnection) -> Result<i64, sqlx::Error> {
    c.fetch_one("SELECT count(*) FROM pg_prepared_statements")
        .await?
        .try_get(0)
}

/// Calls of every shape on a one-connection pool: typed parameters, a composite result, a
/// failing statement, a transaction of two statements.
async fn exercise(db: &Db) {
    for i in 0..5_i64 {
        let n: i64 = db
            .run(async |c| sqlx::query_scalar("SELECT $1::int8 + 1").bind(i).fetch_one(c).await)
            .await
            .unwrap();
        assert_eq!(n, i + 1);
    }
    let failed = db
        .run(async |c| sqlx::query("SELECT 1 / $1").bind(0_i32).execute(c).await)
        .await;
    assert!(failed.is_err(), "division by zero fails");
    let both: (i64, i64) = db
        .transaction(async |c| {
            let a = sqlx::query_scalar("SELECT $1::int8")
                .bind(7_i64)
                .fetch_one(&mut *c)
                .await?;
            let b = sqlx::query_scalar("SELECT $1::int8")
                .bind(8_i64)
                .fetch_one(&mut *c)
                .await?;
            Ok((a, b))
        })
        .await
        .unwrap();
    assert_eq!(both, (7, 8));
}

#[tokio::test]
async fn in_transaction_mode_no_prepared_statement_outlives_its_call() {
    let mut settings = test_settings();
    settings.db_pool_size = 1;
    settings.db_pooler = Pooler::Transaction;
    let db = Db::new(&settings).unwrap();
    exercise(&db).await;
    assert_eq!(db.run(async |c| prepared_statements(c).await).await.unwrap(), 0);

    // The check can fail: mode `none` keeps its statements prepared on the connection.
    settings.db_pooler = Pooler::None;
    settings.database_url = crate::support::helpers::database_url();
    let direct = Db::new(&settings).unwrap();
    exercise(&direct).await;
    assert!(direct.run(async |c| prepared_statements(c).await).await.unwrap() >= 2);
    db.close().await;
    direct.close().await;
}

#[tokio::test]
async fn every_session_runs_without_jit_in_either_mode() {
    // Found from outside: a claim's plan, cached with the statistics of a large backlog,
    // was JIT-compiled on every call (0.5-0.8 s each, reading 50-250 buffers) until the next
    // ANALYZE. oncepay's statements are short: its sessions run with `jit = off`, from the
    // start-up packet in mode `none` and in each transaction's `BEGIN` in mode `transaction`.
    for pooler in [Pooler::None, Pooler::Transaction] {
        let mut settings = test_settings();
        settings.db_pool_size = 1;
        settings.db_pooler = pooler;
        if pooler == Pooler::None {
            settings.database_url = crate::support::helpers::database_url();
        }
        let db = Db::new(&settings).unwrap();
        let jit: String = db
            .run(async |c| sqlx::query_scalar("SELECT current_setting('jit')").fetch_one(c).await)
            .await
            .unwrap();
        let in_transaction: String = db
            .transaction(async |c| sqlx::query_scalar("SELECT current_setting('jit')").fetch_one(c).await)
            .await
            .unwrap();
        assert_eq!((jit.as_str(), in_transaction.as_str()), ("off", "off"), "{pooler:?}");
        db.close().await;
    }
}
