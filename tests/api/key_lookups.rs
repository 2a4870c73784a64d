//! A payment finds its key row through the index even on a connection that planned its
//! statements while the table's statistics said "empty" (migrations/V26): PL/pgSQL keeps a
//! connection's plans until the next ANALYZE, so a plan made then, a sequential scan, would
//! read every key row on every payment while the table grows.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use crate::support::helpers::{drop_database, new_key, spawn_app_on_own_database_with};

/// Key rows the test adds behind the statistics' back: a sequential scan reads all of them.
const GROWN: i64 = 20_000;

/// `(seq_scan + idx_scan, seq_tup_read)` of idempotency_keys as the backends have reported
/// them (PostgreSQL 15 reports a backend's counts at most once a second, when it is idle).
async fn key_reads(conn: &mut PgConnection) -> (i64, i64) {
    sqlx::query_as(
        "SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0), coalesce(seq_tup_read, 0)
           FROM pg_stat_user_tables WHERE relname = 'idempotency_keys'",
    )
    .fetch_one(conn)
    .await
    .unwrap()
}

/// A database vacuumed and analysed while idempotency_keys is empty (as `vacuumdb --analyze`
/// after a restore, or autovacuum after a purge that emptied it, leaves it), autovacuum off so
/// that nothing analyses it again during the test; one pooled connection plans its payments
/// there, then the table grows by 20,000 rows; the next 20 payments read no row by a
/// sequential scan. Without V26 each of them scans all 20,000.
#[tokio::test]
async fn payments_planned_on_an_empty_key_table_still_find_keys_by_the_index_after_it_grows() {
    let (app, url) = spawn_app_on_own_database_with("key_lookups", |s| s.db_pool_size = 1).await;
    let mut conn = PgConnection::connect(&url).await.unwrap();
    sqlx::query("ALTER TABLE idempotency_keys SET (autovacuum_enabled = false)")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("VACUUM (ANALYZE) idempotency_keys")
        .execute(&mut conn)
        .await
        .unwrap();
    // More than five: PL/pgSQL's statements go from custom plans to the connection's cached
    // generic plan after five executions.
    for _ in 0..10 {
        assert_eq!(app.pay(Some(&new_key()), 1).await.status, 201);
    }
    sqlx::query(
        "INSERT INTO idempotency_keys (tenant_id, key, fingerprint, operation, method, path, status,
                                       resource_id, created_at, expires_at)
         SELECT $1, 'grown-' || g, sha256(g::text::bytea), 'pay', 'POST', '/payments', 201, gen_random_uuid()::text,
                now(), now() + interval '1 day'
           FROM generate_series(1, $2) g",
    )
    .bind(app.tenant_id)
    .bind(GROWN)
    .execute(&mut conn)
    .await
    .unwrap();
    for _ in 0..20 {
        assert_eq!(app.pay(Some(&new_key()), 1).await.status, 201);
    }
    // Wait until the server's connection has reported the lookups of all 30 payments.
    let deadline = Instant::now() + Duration::from_secs(30);
    let (lookups, rows_scanned) = loop {
        let (lookups, rows_scanned) = key_reads(&mut conn).await;
        if lookups >= 30 {
            break (lookups, rows_scanned);
        }
        assert!(
            Instant::now() < deadline,
            "only {lookups} lookups of idempotency_keys reported after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        rows_scanned < GROWN,
        "{lookups} lookups read {rows_scanned} key rows by sequential scans: the plan made on the empty \
         table was kept"
    );
    drop(conn);
    drop_database(&url).await;
}
