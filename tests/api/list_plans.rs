//! Every list reads its page through an index, however large its table (docs/api.md, lists):
//! on a database of its own with tens of thousands of rows of two tenants, analysed, each list
//! query (as the server runs it, with a custom plan and with the generic plan a long-lived
//! connection comes to) reads no row by a sequential scan and fetches about the page's rows
//! through the index, on the first page and deep in the list. In the spirit of the planner
//! tests of tests/api/webhooks/planner.rs, counted by PostgreSQL's own per-transaction statistics.

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use oncepay::domain::page::{Created, Cursor, PageRequest};
use oncepay::domain::{AccountId, AttemptId, EndpointId, EventId, PaymentId, TenantId, TopUpId, TransferId};
use oncepay::ledger::lists::{self, PaymentStatus};
use oncepay::webhooks::recovery::{self, AttemptOutcome};

use crate::support::helpers::{drop_database, empty_database};

const LIMIT: u32 = 25;
/// The buffers a page of a time window may touch: its rows' index and heap pages and the
/// cursor's look-up (3-19 seen), not the index between the list's end and the window (31-350
/// before: a scan from the end of the list or the cursor).
const WINDOW_BUFFERS: i64 = 25;

/// Rows of `table` this backend read and has not reported yet: (by sequential scans, fetched
/// through an index). PostgreSQL 15 keeps a backend's counts until it reports them (at most
/// once a second), so they may include the previous transactions': read them before and after.
pub async fn reads(conn: &mut PgConnection, table: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT coalesce(seq_tup_read, 0), coalesce(idx_tup_fetch, 0)
           FROM pg_stat_xact_user_tables WHERE relname = $1",
    )
    .bind(table)
    .fetch_one(conn)
    .await
    .unwrap()
}

/// Two tenants with many rows each in every listed table; gives the first.
async fn fill(conn: &mut PgConnection) -> (Uuid, Uuid) {
    let (tenant, endpoint) = (Uuid::new_v4(), Uuid::new_v4());
    // Nothing but the test's own statements touches its database's buffers
    // ([`buffers_touched`]).
    for table in [
        "tenants",
        "accounts",
        "payments",
        "transfers",
        "top_ups",
        "webhook_events",
        "webhook_endpoints",
        "webhook_attempts",
    ] {
        sqlx::query(&format!("ALTER TABLE {table} SET (autovacuum_enabled = false)"))
            .execute(&mut *conn)
            .await
            .unwrap();
    }
    for t in [tenant, Uuid::new_v4()] {
        sqlx::query(
            "INSERT INTO tenants (tenant_id, name, api_key_hash, missing_key_policy)
             VALUES ($1, 'plans', decode(md5($1::text), 'hex'), 'reject')",
        )
        .bind(t)
        .execute(&mut *conn)
        .await
        .unwrap();
        for statement in [
            "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance, created_at)
             SELECT $1, 'a' || g, 1000000, 1000000, now() - make_interval(secs => g) FROM generate_series(1, 3000) g",
            "INSERT INTO payments (tenant_id, payment_id, account_id, amount, balance_after, created_at, refunded_at,
                                   balance_after_refund)
             SELECT $1, gen_random_uuid(), 'a' || (g % 50 + 1), 1, 1, now() - make_interval(secs => g / 3.0),
                    CASE WHEN g % 2 = 0 THEN now() END, CASE WHEN g % 2 = 0 THEN 2 END
               FROM generate_series(1, 40000) g",
            "INSERT INTO transfers (tenant_id, transfer_id, from_account_id, to_account_id, amount, from_balance_after,
                                    to_balance_after, created_at)
             SELECT $1, gen_random_uuid(), 'a' || (g % 50 + 1), 'a' || (g % 50 + 2), 1, 1, 1,
                    now() - make_interval(secs => g / 3.0)
               FROM generate_series(1, 20000) g",
            "INSERT INTO top_ups (tenant_id, top_up_id, account_id, amount, currency, payment_method, status,
                                  recovery_point, balance_after, created_at, updated_at, processor)
             SELECT $1, gen_random_uuid(), 'a1', 5, 'usd', 'pm_card_visa', 'succeeded', 'finished', 5,
                    now() - make_interval(secs => g), now(), 'plans'
               FROM generate_series(1, 10000) g",
            "INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at)
             SELECT $1, gen_random_uuid(), 'payment.succeeded', 'pay_' || g, '{}', now() - make_interval(secs => g)
               FROM generate_series(1, 20000) g",
        ] {
            sqlx::query(statement).bind(t).execute(&mut *conn).await.unwrap();
        }
    }
    sqlx::query(
        "WITH e AS (INSERT INTO webhook_endpoints (tenant_id, endpoint_id, url, secret_encrypted, created_at)
                    VALUES ($1, $2, 'https://example.com/hooks', '\\x00', now() - interval '1 day'))
         INSERT INTO webhook_attempts (tenant_id, event_id, endpoint_id, attempt, started_at, latency_ms, status, error)
         SELECT $1, gen_random_uuid(), $2, 1 + g % 3, now() - make_interval(secs => g), 5,
                CASE WHEN g % 4 = 0 THEN NULL ELSE 200 END, CASE WHEN g % 4 = 0 THEN 'refused' END
           FROM generate_series(1, 20000) g",
    )
    .bind(tenant)
    .bind(endpoint)
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::query("ANALYZE").execute(&mut *conn).await.unwrap();
    (tenant, endpoint)
}

/// An id deep in a list: the `n`th newest of `sql`'s rows.
async fn nth(conn: &mut PgConnection, sql: &str, tenant: Uuid, n: i64) -> String {
    sqlx::query_scalar(sql)
        .bind(tenant)
        .bind(n)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// Plans this connection's statements as `mode` says (`force_custom_plan`,
/// `force_generic_plan`).
async fn plan_cache_mode(conn: &mut PgConnection, mode: &str) {
    sqlx::query(&format!("SET plan_cache_mode = {mode}"))
        .execute(conn)
        .await
        .unwrap();
}

fn pages<Id>(cursor: Option<Cursor<Id>>) -> PageRequest<Id> {
    PageRequest::new(LIMIT, cursor, Created::default()).unwrap()
}

/// Buffers this database's backends have touched so far (hit or read), as PostgreSQL's
/// statistics tell once this backend has reported its counts (forced at its next idle
/// moment). Only this test uses its database, its tables without autovacuum.
async fn buffers_touched(conn: &mut PgConnection) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query_scalar("SELECT blks_hit + blks_read FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// A page of a time window that lies deep in the list: created before `until` seconds ago
/// (newest first; `cursor` none, or a row newer than the window), or at or after `from`
/// seconds ago (oldest first, `cursor` a row older than the window).
fn window<Id>(cursor: Option<Cursor<Id>>, from: Option<i64>, until: Option<i64>) -> PageRequest<Id> {
    let ago = |secs: i64| chrono::Utc::now() - chrono::Duration::seconds(secs);
    let created = Created {
        from: from.map(ago),
        until: until.map(ago),
    };
    PageRequest::new(LIMIT, cursor, created).unwrap()
}

/// Runs one list of a time window deep in its table; asserts it read about a page of index
/// entries, not every entry between the list's end (or its cursor) and the window: found
/// from outside, the first page of `created[lt]` 29 days back read 20,000 buffers of a
/// tenant's 2.5 million payments (149 ms; 2.9 ms without the bound).
macro_rules! assert_window_read_a_page {
    ($conn:expr, $what:expr, $call:expr) => {{
        // Once first: its plan made and its catalogs cached, as on a connection in use.
        let _ = $call.await.unwrap();
        let before = buffers_touched(&mut *$conn).await;
        let listed = $call.await.unwrap().expect("a known cursor");
        let touched = buffers_touched(&mut *$conn).await - before;
        assert_eq!(listed.items.len(), LIMIT as usize, "{}", $what);
        assert!(
            touched <= WINDOW_BUFFERS,
            "{}: {touched} buffers touched for a page of {LIMIT}",
            $what,
        );
    }};
}

/// Runs one list in a transaction of its own; asserts its table was read through an index
/// only, about a page of rows (`bounded`: whether the fetches are bounded by the page, false
/// for a filter that is not a column of the index).
macro_rules! assert_indexed {
    ($conn:expr, $table:expr, $what:expr, $bounded:expr, $call:expr) => {{
        sqlx::query("BEGIN").execute(&mut *$conn).await.unwrap();
        let (seq_before, fetched_before) = reads(&mut *$conn, $table).await;
        let listed = $call.await.unwrap();
        let (seq, fetched) = reads(&mut *$conn, $table).await;
        let (seq, fetched) = (seq - seq_before, fetched - fetched_before);
        sqlx::query("COMMIT").execute(&mut *$conn).await.unwrap();
        assert_eq!(seq, 0, "{}: {seq} rows of {} read by a sequential scan", $what, $table);
        if $bounded {
            assert!(
                fetched <= 2 * i64::from(LIMIT + 1) + 4,
                "{}: {fetched} rows of {} fetched for a page of {LIMIT}",
                $what,
                $table
            );
        }
        listed
    }};
}

#[tokio::test]
async fn every_list_reads_its_page_through_an_index_however_deep_and_however_large_its_table() {
    let url = empty_database("list_plans").await;
    oncepay::db::migrate(&url).await.unwrap();
    let mut conn = PgConnection::connect(&url).await.unwrap();
    let (tenant_uuid, endpoint) = fill(&mut conn).await;
    let tenant = TenantId::from_uuid(tenant_uuid);
    let endpoint = EndpointId::from_uuid(endpoint);

    let deep_payment = nth(
        &mut conn,
        "SELECT payment_id::text FROM payments WHERE tenant_id = $1 ORDER BY created_at DESC, payment_id DESC OFFSET $2 LIMIT 1",
        tenant_uuid,
        30_000,
    )
    .await;
    let deep_payment = PaymentId::parse(&deep_payment).unwrap();
    let deep_transfer = TransferId::parse(
        &nth(
            &mut conn,
            "SELECT transfer_id::text FROM transfers WHERE tenant_id = $1 ORDER BY created_at DESC, transfer_id DESC OFFSET $2 LIMIT 1",
            tenant_uuid,
            15_000,
        )
        .await,
    )
    .unwrap();
    let deep_top_up = TopUpId::parse(
        &nth(
            &mut conn,
            "SELECT top_up_id::text FROM top_ups WHERE tenant_id = $1 ORDER BY created_at DESC, top_up_id DESC OFFSET $2 LIMIT 1",
            tenant_uuid,
            8_000,
        )
        .await,
    )
    .unwrap();
    let deep_account = AccountId::parse(
        &nth(
            &mut conn,
            "SELECT account_id::text FROM accounts WHERE tenant_id = $1 ORDER BY created_at DESC, account_id DESC OFFSET $2 LIMIT 1",
            tenant_uuid,
            2_000,
        )
        .await,
    )
    .unwrap();
    let deep_event = EventId::parse(
        &nth(
            &mut conn,
            "SELECT event_id::text FROM webhook_events WHERE tenant_id = $1 ORDER BY created_at DESC, event_id DESC OFFSET $2 LIMIT 1",
            tenant_uuid,
            15_000,
        )
        .await,
    )
    .unwrap();
    let deep_attempt = AttemptId::parse(
        &nth(
            &mut conn,
            "SELECT event_id::text || '.' || attempt FROM webhook_attempts WHERE tenant_id = $1
              ORDER BY started_at DESC, event_id DESC, attempt DESC OFFSET $2 LIMIT 1",
            tenant_uuid,
            15_000,
        )
        .await,
    )
    .unwrap();
    let account = AccountId::parse("a7").unwrap();

    // A long-lived connection comes to the generic plan after five executions; check both.
    for mode in ["force_custom_plan", "force_generic_plan"] {
        plan_cache_mode(&mut conn, mode).await;
        for cursor in [
            None,
            Some(Cursor::After(deep_payment)),
            Some(Cursor::Before(deep_payment)),
        ] {
            let what = format!("{mode}, payments, {cursor:?}");
            let page = pages(cursor.clone());
            let listed = assert_indexed!(
                &mut conn,
                "payments",
                &what,
                true,
                lists::payments(&mut conn, tenant, None, None, &page)
            );
            assert_eq!(listed.unwrap().items.len(), LIMIT as usize, "{what}");
            let listed = assert_indexed!(
                &mut conn,
                "payments",
                &format!("{what}, account"),
                true,
                lists::payments(&mut conn, tenant, Some(&account), None, &page)
            );
            assert!(listed.is_some());
            assert_indexed!(
                &mut conn,
                "payments",
                &format!("{what}, status"),
                false,
                lists::payments(&mut conn, tenant, None, Some(PaymentStatus::Refunded), &page)
            );
        }
        for cursor in [
            None,
            Some(Cursor::After(deep_transfer)),
            Some(Cursor::Before(deep_transfer)),
        ] {
            let what = format!("{mode}, transfers, {cursor:?}");
            let page = pages(cursor);
            let listed = assert_indexed!(
                &mut conn,
                "transfers",
                &what,
                true,
                lists::transfers(&mut conn, tenant, None, &page)
            );
            assert_eq!(listed.unwrap().items.len(), LIMIT as usize, "{what}");
            assert_indexed!(
                &mut conn,
                "transfers",
                &format!("{what}, account"),
                true,
                lists::transfers(&mut conn, tenant, Some(&account), &page)
            );
        }
        for cursor in [
            None,
            Some(Cursor::After(deep_top_up)),
            Some(Cursor::Before(deep_top_up)),
        ] {
            let what = format!("{mode}, top-ups, {cursor:?}");
            let listed = assert_indexed!(
                &mut conn,
                "top_ups",
                &what,
                true,
                lists::top_ups(&mut conn, tenant, None, &pages(cursor))
            );
            assert_eq!(listed.unwrap().items.len(), LIMIT as usize, "{what}");
        }
        for cursor in [
            None,
            Some(Cursor::After(deep_account.clone())),
            Some(Cursor::Before(deep_account.clone())),
        ] {
            let what = format!("{mode}, accounts, {cursor:?}");
            let listed = assert_indexed!(
                &mut conn,
                "accounts",
                &what,
                true,
                lists::accounts(&mut conn, tenant, &pages(cursor))
            );
            assert_eq!(listed.unwrap().items.len(), LIMIT as usize, "{what}");
        }
        for cursor in [None, Some(Cursor::After(deep_event)), Some(Cursor::Before(deep_event))] {
            let what = format!("{mode}, events, {cursor:?}");
            let listed = assert_indexed!(
                &mut conn,
                "webhook_events",
                &what,
                true,
                recovery::events(&mut conn, tenant, None, &pages(cursor))
            );
            assert_eq!(listed.unwrap().items.len(), LIMIT as usize, "{what}");
        }
        for cursor in [
            None,
            Some(Cursor::After(deep_attempt)),
            Some(Cursor::Before(deep_attempt)),
        ] {
            let what = format!("{mode}, attempts, {cursor:?}");
            let page = pages(cursor);
            let listed = assert_indexed!(
                &mut conn,
                "webhook_attempts",
                &what,
                true,
                recovery::attempts(&mut conn, tenant, endpoint, None, &page)
            );
            assert_eq!(listed.unwrap().items.len(), LIMIT as usize, "{what}");
            let failed = assert_indexed!(
                &mut conn,
                "webhook_attempts",
                &format!("{what}, failed"),
                false,
                recovery::attempts(&mut conn, tenant, endpoint, Some(AttemptOutcome::Failed), &page)
            );
            assert!(failed.unwrap().items.iter().all(|a| a.status.is_none()), "{what}");
        }
    }
    // The count's own statements planned once (their catalogs read) before anything counts.
    buffers_touched(&mut conn).await;
    for mode in ["force_custom_plan", "force_generic_plan"] {
        plan_cache_mode(&mut conn, mode).await;
        // Newest first, before 2,500 s ago (thousands of rows newer in every table), from the
        // end or from a cursor newer than the window; oldest first, from 300 s ago, from a
        // cursor older than the window (thousands of rows older).
        let newest = |table: &str, id: &str| {
            format!("SELECT {id}::text FROM {table} WHERE tenant_id = $1 ORDER BY created_at DESC OFFSET $2 LIMIT 1")
        };
        let recent_payment = PaymentId::parse(&nth(&mut conn, &newest("payments", "payment_id"), tenant_uuid, 5).await);
        let recent_transfer =
            TransferId::parse(&nth(&mut conn, &newest("transfers", "transfer_id"), tenant_uuid, 5).await);
        let recent_top_up = TopUpId::parse(&nth(&mut conn, &newest("top_ups", "top_up_id"), tenant_uuid, 5).await);
        let recent_account = AccountId::parse(&nth(&mut conn, &newest("accounts", "account_id"), tenant_uuid, 5).await);
        let recent_event = EventId::parse(&nth(&mut conn, &newest("webhook_events", "event_id"), tenant_uuid, 5).await);
        for (cursor, from, until) in [
            (None, None, Some(2_500)),
            (recent_payment.map(Cursor::After), None, Some(2_500)),
            (Some(Cursor::Before(deep_payment)), Some(300), None),
        ] {
            let what = format!("{mode}, payments window, {cursor:?}");
            let page = window(cursor, from, until);
            assert_window_read_a_page!(&mut conn, &what, lists::payments(&mut conn, tenant, None, None, &page));
        }
        for (cursor, from, until) in [
            (None, None, Some(2_500)),
            (recent_transfer.map(Cursor::After), None, Some(2_500)),
            (Some(Cursor::Before(deep_transfer)), Some(300), None),
        ] {
            let what = format!("{mode}, transfers window, {cursor:?}");
            let page = window(cursor, from, until);
            assert_window_read_a_page!(&mut conn, &what, lists::transfers(&mut conn, tenant, None, &page));
        }
        for (cursor, from, until) in [
            (None, None, Some(2_500)),
            (recent_top_up.map(Cursor::After), None, Some(2_500)),
            (Some(Cursor::Before(deep_top_up)), Some(300), None),
        ] {
            let what = format!("{mode}, top-ups window, {cursor:?}");
            let page = window(cursor, from, until);
            assert_window_read_a_page!(&mut conn, &what, lists::top_ups(&mut conn, tenant, None, &page));
        }
        for (cursor, from, until) in [
            (None, None, Some(2_500)),
            (recent_account.clone().ok().map(Cursor::After), None, Some(2_500)),
            (Some(Cursor::Before(deep_account.clone())), Some(300), None),
        ] {
            let what = format!("{mode}, accounts window, {cursor:?}");
            let page = window(cursor, from, until);
            assert_window_read_a_page!(&mut conn, &what, lists::accounts(&mut conn, tenant, &page));
        }
        for (cursor, from, until) in [
            (None, None, Some(2_500)),
            (recent_event.map(Cursor::After), None, Some(2_500)),
            (Some(Cursor::Before(deep_event)), Some(300), None),
        ] {
            let what = format!("{mode}, events window, {cursor:?}");
            let page = window(cursor, from, until);
            assert_window_read_a_page!(&mut conn, &what, recovery::events(&mut conn, tenant, None, &page));
        }
        for (cursor, from, until) in [
            (None, None, Some(2_500)),
            (Some(Cursor::Before(deep_attempt)), Some(300), None),
        ] {
            let what = format!("{mode}, attempts window, {cursor:?}");
            let page = window(cursor, from, until);
            assert_window_read_a_page!(
                &mut conn,
                &what,
                recovery::attempts(&mut conn, tenant, endpoint, None, &page)
            );
        }
    }
    drop(conn);
    drop_database(&url).await;
}

/// A page of refunds reads refunded payments only (migrations/V41): found from outside, the
/// first page of `status=refunded` under 15,695 newer unrefunded payments took 12.7 ms (every
/// one of them read on the heap and skipped); a tenant refunding rarely would have its whole
/// list read. Here 60 refunds are the oldest of 30,000 payments: each page of them, first,
/// after and before a cursor, with either plan, touches about the page's buffers.
#[tokio::test]
async fn a_page_of_refunds_reads_refunded_payments_only_however_rare_they_are() {
    let url = empty_database("list_plans_refunds").await;
    oncepay::db::migrate(&url).await.unwrap();
    let mut conn = PgConnection::connect(&url).await.unwrap();
    sqlx::query("ALTER TABLE payments SET (autovacuum_enabled = false)")
        .execute(&mut conn)
        .await
        .unwrap();
    let tenant_uuid = Uuid::new_v4();
    for t in [tenant_uuid, Uuid::new_v4()] {
        for statement in [
            "INSERT INTO tenants (tenant_id, name, api_key_hash, missing_key_policy)
             VALUES ($1, 'refunds', decode(md5($1::text), 'hex'), 'reject')",
            "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance) VALUES ($1, 'a', 1000000, 1000000)",
            "INSERT INTO payments (tenant_id, payment_id, account_id, amount, balance_after, created_at, refunded_at,
                                   balance_after_refund)
             SELECT $1, gen_random_uuid(), 'a', 1, 1, now() - make_interval(secs => g / 3.0),
                    CASE WHEN g > 29940 THEN now() END, CASE WHEN g > 29940 THEN 2 END
               FROM generate_series(1, 30000) g",
        ] {
            sqlx::query(statement).bind(t).execute(&mut conn).await.unwrap();
        }
    }
    sqlx::query("ANALYZE").execute(&mut conn).await.unwrap();
    let tenant = TenantId::from_uuid(tenant_uuid);
    let refund = |n: i64| {
        format!(
            "SELECT payment_id::text FROM payments WHERE tenant_id = $1 AND refunded_at IS NOT NULL
              ORDER BY created_at DESC, payment_id DESC OFFSET {n} LIMIT 1"
        )
    };
    let tenth = PaymentId::parse(&nth(&mut conn, &refund(9), tenant_uuid, 0).await).unwrap();
    let fiftieth = PaymentId::parse(&nth(&mut conn, &refund(49), tenant_uuid, 0).await).unwrap();
    // An unrefunded payment as the cursor: the page holds the refunds older than it.
    let newest = nth(
        &mut conn,
        "SELECT payment_id::text FROM payments WHERE tenant_id = $1 ORDER BY created_at DESC OFFSET $2 LIMIT 1",
        tenant_uuid,
        0,
    )
    .await;
    let newest = PaymentId::parse(&newest).unwrap();

    for mode in ["force_custom_plan", "force_generic_plan"] {
        plan_cache_mode(&mut conn, mode).await;
        for cursor in [
            None,
            Some(Cursor::After(newest)),
            Some(Cursor::After(tenth)),
            Some(Cursor::Before(fiftieth)),
        ] {
            let what = format!("{mode}, refunds, {cursor:?}");
            let page = pages(cursor);
            // Once first: its plan made and its catalogs cached, as on a connection in use.
            let mut listed = None;
            let mut before = 0;
            for run in 0..2 {
                before = buffers_touched(&mut conn).await;
                listed = lists::payments(&mut conn, tenant, None, Some(PaymentStatus::Refunded), &page)
                    .await
                    .unwrap();
                assert!(listed.is_some(), "{what}: run {run}, a known cursor");
            }
            let listed = listed.unwrap();
            let touched = buffers_touched(&mut conn).await - before;
            assert_eq!(listed.items.len(), LIMIT as usize, "{what}");
            assert!(listed.items.iter().all(|p| p.refunded_at.is_some()), "{what}");
            assert!(
                touched <= WINDOW_BUFFERS,
                "{what}: {touched} buffers touched for a page of {LIMIT}"
            );
        }
    }
    drop(conn);
    drop_database(&url).await;
}
