//! List pages are read through a pool of their own (`Db::for_lists`) whose sessions plan each
//! list statement once: PostgreSQL's own choice re-planned every page (a custom plan folds the
//! absent filters and cursor away, so it always looked cheaper than the generic one), about
//! half of PostgreSQL's cost of a page. A plan kept for good must not be one made while the
//! statistics said "empty": the list pool's sessions never scan a table.
//!
//! Direct connections in mode `none` (the list pool's settings travel in the start-up packet,
//! which a transaction-mode pooler refuses; there no statement is kept prepared at all).

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use oncepay::config::{Pooler, Settings};
use oncepay::db::Db;
use oncepay::domain::page::{Created, Cursor, PageRequest};
use oncepay::domain::{PaymentId, TenantId};
use oncepay::ledger::lists;

use crate::list_plans::reads;
use crate::support::helpers::{
    drop_database, empty_database, metric_value, spawn_app_on_own_database_with, test_settings, waiting_behind,
};

const LIMIT: u32 = 25;

/// A migrated database of its own and settings for a server on it, direct, mode `none`.
async fn database(hint: &str) -> (String, Settings) {
    let url = empty_database(hint).await;
    oncepay::db::migrate(&url).await.unwrap();
    let mut settings = test_settings();
    settings.database_url = url.clone();
    settings.db_pooler = Pooler::None;
    (url, settings)
}

/// A tenant with one account and `n` payments, a second apart, newest now.
async fn tenant_with_payments(conn: &mut PgConnection, n: i64) -> TenantId {
    let tenant = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO tenants (tenant_id, name, api_key_hash, missing_key_policy)
         VALUES ($1, 'list pool', decode(md5($1::text), 'hex'), 'reject')",
    )
    .bind(tenant)
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance) VALUES ($1, 'a1', 1000000, 1000000)",
    )
    .bind(tenant)
    .execute(&mut *conn)
    .await
    .unwrap();
    add_payments(conn, tenant, n).await;
    TenantId::from_uuid(tenant)
}

async fn add_payments(conn: &mut PgConnection, tenant: Uuid, n: i64) {
    sqlx::query(
        "INSERT INTO payments (tenant_id, payment_id, account_id, amount, balance_after, created_at)
         SELECT $1, gen_random_uuid(), 'a1', 1, 1, now() - make_interval(secs => g) FROM generate_series(1, $2) g",
    )
    .bind(tenant)
    .bind(n)
    .execute(conn)
    .await
    .unwrap();
}

fn page(cursor: Option<Cursor<PaymentId>>) -> PageRequest<PaymentId> {
    PageRequest::new(LIMIT, cursor, Created::default()).unwrap()
}

/// On one connection of `db`: the first page of the tenant's payments `first` times, then
/// `deeper` pages each after the previous one's last item; then how often PostgreSQL planned
/// the list's statement on that connection: (generic plans, custom plans).
async fn page_through(db: &Db, tenant: TenantId, first: usize, deeper: usize) -> (i64, i64) {
    let mut conn = db.conn().await.unwrap();
    conn.run(async |c| {
        let mut cursor = None;
        for n in 0..first + deeper {
            let listed = lists::payments(c, tenant, None, None, &page(cursor.clone()))
                .await?
                .unwrap();
            assert_eq!(listed.items.len(), LIMIT as usize);
            if n + 1 >= first {
                cursor = Some(Cursor::After(PaymentId::from_uuid(
                    listed.items.last().unwrap().payment_id,
                )));
            }
        }
        sqlx::query_as(
            "SELECT coalesce(sum(generic_plans), 0)::bigint, coalesce(sum(custom_plans), 0)::bigint
               FROM pg_prepared_statements
              WHERE statement LIKE '%FROM payments r%' AND statement NOT LIKE '%pg_prepared_statements%'",
        )
        .fetch_one(&mut *c)
        .await
    })
    .await
    .unwrap()
}

async fn setting(db: &Db, name: &str) -> String {
    db.run(async |c| sqlx::query_scalar(&format!("SHOW {name}")).fetch_one(c).await)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_list_pool_plans_each_page_once_where_the_main_pool_plans_it_every_time() {
    let (url, settings) = database("list_pool_plans").await;
    let mut conn = PgConnection::connect(&url).await.unwrap();
    let tenant = tenant_with_payments(&mut conn, 1_000).await;
    sqlx::query("ANALYZE").execute(&mut conn).await.unwrap();
    let main = Db::new(&settings).unwrap();
    let for_lists = Db::for_lists(&settings, &main).unwrap();

    // The first page eight times, then eight pages through a cursor (one statement: past the
    // five executions after which PostgreSQL may settle on the generic plan).
    let (generic, custom) = page_through(&for_lists, tenant, 8, 8).await;
    assert_eq!((generic, custom), (16, 0), "list pool: (generic, custom) plans");
    assert_eq!(setting(&for_lists, "plan_cache_mode").await, "force_generic_plan");
    assert_eq!(setting(&for_lists, "enable_seqscan").await, "off");

    // Why the pool exists: on PostgreSQL's own choice the first page was planned anew every
    // time (its custom plan folds the absent cursor and filters away, so the generic plan
    // never looks cheaper).
    let (generic, custom) = page_through(&main, tenant, 8, 0).await;
    assert_eq!((generic, custom), (0, 8), "main pool: (generic, custom) plans");
    assert_eq!(setting(&main, "plan_cache_mode").await, "auto");
    assert_eq!(setting(&main, "enable_seqscan").await, "on");

    main.close().await;
    for_lists.close().await;
    drop(conn);
    drop_database(&url).await;
}

/// The list pool's plans are kept until the next ANALYZE. Planned while payments was analysed
/// empty (autovacuum off, so that nothing analyses it again), then grown by 20,000 rows behind
/// the statistics' back: the first page still reads no row by a sequential scan and fetches
/// about a page through the index. Without `enable_seqscan = off` its plan is a scan and a
/// sort of the whole table.
#[tokio::test]
async fn a_list_planned_on_an_empty_table_still_reads_its_page_through_the_index_after_it_grows() {
    let (url, mut settings) = database("list_pool_empty").await;
    settings.db_pool_size = 4; // one list connection: the one that made the plans
    let mut conn = PgConnection::connect(&url).await.unwrap();
    let tenant = tenant_with_payments(&mut conn, 0).await;
    sqlx::query("ALTER TABLE payments SET (autovacuum_enabled = false)")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("VACUUM (ANALYZE) payments")
        .execute(&mut conn)
        .await
        .unwrap();
    let main = Db::new(&settings).unwrap();
    let for_lists = Db::for_lists(&settings, &main).unwrap();
    for _ in 0..6 {
        let empty = for_lists
            .run(async |c| lists::payments(c, tenant, None, None, &page(None)).await)
            .await
            .unwrap()
            .unwrap();
        assert!(empty.items.is_empty());
    }

    add_payments(&mut conn, tenant.get(), 20_000).await;

    let (seq, fetched) = for_lists
        .run(async |c| {
            sqlx::query("BEGIN").execute(&mut *c).await?;
            let before = reads(c, "payments").await;
            let listed = lists::payments(c, tenant, None, None, &page(None)).await?.unwrap();
            assert_eq!(listed.items.len(), LIMIT as usize);
            assert!(listed.has_more);
            let after = reads(c, "payments").await;
            sqlx::query("COMMIT").execute(&mut *c).await?;
            Ok((after.0 - before.0, after.1 - before.1))
        })
        .await
        .unwrap();
    assert_eq!(seq, 0, "{seq} payments read by a sequential scan for a page of {LIMIT}");
    assert!(
        fetched <= i64::from(LIMIT) + 1,
        "{fetched} payments fetched for a page of {LIMIT}"
    );

    main.close().await;
    for_lists.close().await;
    drop(conn);
    drop_database(&url).await;
}

/// A page that waits for the list pool's one connection (the first page holds it, waiting on
/// a lock the test holds) counts in `oncepay_db_pool_waiting`, as any request waiting for a
/// connection does; both pages are answered once the lock goes.
///
/// The gauge is read only once the first page's statement waits on the lock: before that the
/// first page may itself still be waiting for the connection being opened, and the gauge then
/// rightly reads 2 (CI saw it, 2026-12-05).
#[tokio::test]
async fn a_page_waiting_for_a_list_connection_counts_as_a_request_waiting_for_one() {
    let (app, url) = spawn_app_on_own_database_with("list_pool_waiting", |s| {
        s.db_pool_size = 4; // one list connection
        s.workers = 1; // its one pool: both pages ask the same worker
        s.db_acquire_timeout = Duration::from_secs(10);
    })
    .await;
    let mut lock = PgConnection::connect(&url).await.unwrap();
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut lock)
        .await
        .unwrap();
    sqlx::query("BEGIN").execute(&mut lock).await.unwrap();
    sqlx::query("LOCK TABLE payments IN ACCESS EXCLUSIVE MODE")
        .execute(&mut lock)
        .await
        .unwrap();
    let watch = async {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut blocked = 0;
        let mut waiting = 0.0;
        while Instant::now() < deadline {
            blocked = waiting_behind(&app.pool, holder).await;
            waiting = metric_value(&app.metrics().await, "oncepay_db_pool_waiting");
            if blocked >= 1 && waiting >= 1.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        sqlx::query("COMMIT").execute(&mut lock).await.unwrap();
        (blocked, waiting)
    };

    let (first, second, (blocked, waiting)) = tokio::join!(app.get("/payments"), app.get("/payments"), watch);

    assert_eq!(blocked, 1, "one page's statement waited on the lock");
    assert_eq!(
        waiting, 1.0,
        "requests waiting for a connection while a page held the list pool's one"
    );
    assert_eq!((first.status, second.status), (200, 200));
    let text = app.metrics().await;
    assert_eq!(metric_value(&text, "oncepay_db_pool_waiting"), 0.0);
    assert_eq!(
        metric_value(&text, r#"oncepay_db_list_pool_connections{state="max"}"#),
        1.0
    );
    drop(app);
    drop_database(&url).await;
}
