//! Traps of the planner on the queue tables: analysed while their backlog was empty, the
//! planner believes one pending row; every statement here must stay an index lookup anyway
//! (counted with the statistics views), and no SQL function of a payment is planned again in
//! each transaction.

use uuid::Uuid;

use crate::support::helpers::{drop_database, empty_database};
use sqlx::Connection;

/// Rows of `table` read by this transaction so far: (by sequential scans, fetched through
/// an index).
async fn reads(conn: &mut sqlx::PgConnection, table: &str) -> (i64, i64) {
    sqlx::query_as("SELECT seq_tup_read, idx_tup_fetch FROM pg_stat_xact_user_tables WHERE relname = $1")
        .bind(table)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// Index fetches on webhook_deliveries by this transaction so far.
async fn delivery_fetches(conn: &mut sqlx::PgConnection) -> i64 {
    reads(conn, "webhook_deliveries").await.1
}

/// One claim of at most `limit` deliveries, `limit` slots free, committed: (event, attempt) of
/// each delivery claimed, and the rows of `webhook_deliveries` it fetched through an index.
async fn claim_fetching(conn: &mut sqlx::PgConnection, limit: i32) -> (Vec<(Uuid, i32)>, i64) {
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    let before = delivery_fetches(conn).await;
    let claimed: Vec<(Uuid, i32)> = sqlx::query_as(
        "SELECT event_id, attempt FROM oncepay_webhook_claim_scheduled($1, $1, 600000, false, '{}', '{}', $1,
                                                                    '{}', '{}', '{}', '{}')",
    )
    .bind(limit)
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    let fetched = delivery_fetches(conn).await - before;
    sqlx::query("COMMIT").execute(&mut *conn).await.unwrap();
    (claimed, fetched)
}

/// A migrated database of its own for a test of the planner's choices, autovacuum off on the
/// outbox's tables (the test decides when they are analysed), and a connection to it.
pub(super) async fn planner_database(name: &str) -> (String, sqlx::PgConnection) {
    let url = empty_database(name).await;
    oncepay::db::migrate(&url).await.unwrap();
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    for table in ["webhook_events", "webhook_deliveries"] {
        sqlx::query(&format!("ALTER TABLE {table} SET (autovacuum_enabled = false)"))
            .execute(&mut conn)
            .await
            .unwrap();
    }
    (url, conn)
}

/// `n` deliveries in `state` to the endpoint, of distinct resources, due in `due_in_secs`, in
/// this order, with their events.
pub(super) async fn insert_deliveries(
    conn: &mut sqlx::PgConnection,
    (tenant, endpoint): (Uuid, Uuid),
    n: i32,
    state: &str,
    due_in_secs: i32,
) {
    sqlx::query(
        "WITH d AS (
             INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id, resource_id, state, next_attempt_at,
                                             created_at, finished_at)
             SELECT $1, gen_random_uuid(), $2, 'pay_' || gen_random_uuid(), $3,
                    now() + make_interval(secs => $5), now(), CASE WHEN $3 <> 'pending' THEN now() END
               FROM generate_series(1, $4) g
             RETURNING tenant_id, event_id, resource_id)
         INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at)
         SELECT tenant_id, event_id, 'payment.succeeded', resource_id, '{}', now() FROM d",
    )
    .bind(tenant)
    .bind(endpoint)
    .bind(state)
    .bind(n)
    .bind(f64::from(due_in_secs))
    .execute(conn)
    .await
    .unwrap();
}

/// A tenant with one endpoint, registered an hour ago: (tenant, endpoint).
pub(super) async fn tenant_with_endpoint(conn: &mut sqlx::PgConnection) -> (Uuid, Uuid) {
    let (tenant, endpoint) = (Uuid::new_v4(), Uuid::new_v4());
    sqlx::query(
        "WITH t AS (
             INSERT INTO tenants (tenant_id, name, api_key_hash, missing_key_policy)
             VALUES ($1, 'planner ' || $1, sha256($1::text::bytea), 'reject'))
         INSERT INTO webhook_endpoints (tenant_id, endpoint_id, url, secret_encrypted, created_at)
         VALUES ($1, $2, 'https://example.com/hooks', '\\x00', now() - interval '1 hour')",
    )
    .bind(tenant)
    .bind(endpoint)
    .execute(conn)
    .await
    .unwrap();
    (tenant, endpoint)
}

#[tokio::test]
async fn a_payment_runs_no_sql_function_that_is_planned_again_each_transaction() {
    // A SQL function that PostgreSQL cannot inline (declared IMMUTABLE over a STABLE body, as
    // oncepay_json_time was) is parsed and planned again in every transaction that calls it
    // from PL/pgSQL: 163,000 of a payment's 1,041,000 instructions, spent on the event's data,
    // and spent even for a tenant with no endpoint, which writes no event (migrations/V17).
    // Counted with track_functions, which sees a SQL function only when it runs as a call of
    // its own.
    let (url, mut conn) = planner_database("pay_functions").await;
    let (hooked, _) = tenant_with_endpoint(&mut conn).await;
    let plain = Uuid::new_v4();
    sqlx::query(
        "WITH t AS (
             INSERT INTO tenants (tenant_id, name, api_key_hash, missing_key_policy)
             VALUES ($2, 'planner', '\\x02', 'reject'))
         INSERT INTO accounts (tenant_id, account_id, balance, opening_balance)
         SELECT t, 'main', 1000, 1000 FROM unnest(ARRAY[$1, $2]::uuid[]) t",
    )
    .bind(hooked)
    .bind(plain)
    .execute(&mut conn)
    .await
    .unwrap();

    for (tenant, events) in [(hooked, 1), (plain, 0)] {
        sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
        sqlx::query("SET LOCAL track_functions = 'all'")
            .execute(&mut conn)
            .await
            .unwrap();
        let outcome: String = sqlx::query_scalar(
            "SELECT outcome::text FROM oncepay_pay($1, ROW(NULL, false, NULL, 'pay', 'POST', '/payments', 0, 1000, 201, '{}')::oncepay_claim_args, 'main', 7)",
        )
        .bind(tenant)
        .fetch_one(&mut conn)
        .await
        .unwrap();
        let called: Vec<(String, String)> = sqlx::query_as(
            "SELECT f.funcname::text, l.lanname::text
               FROM pg_stat_xact_user_functions f
               JOIN pg_proc p ON p.oid = f.funcid
               JOIN pg_language l ON l.oid = p.prolang
              ORDER BY 1",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap();
        let written: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_events WHERE tenant_id = $1")
            .bind(tenant)
            .fetch_one(&mut conn)
            .await
            .unwrap();
        sqlx::query("COMMIT").execute(&mut conn).await.unwrap();

        assert_eq!(outcome, "created");
        assert_eq!(written, events, "events written for tenant {tenant}");
        assert!(
            called.iter().any(|(name, _)| name == "oncepay_pay"),
            "track_functions counted no call at all: {called:?}"
        );
        let planned: Vec<_> = called.iter().filter(|(_, language)| language == "sql").collect();
        assert!(
            planned.is_empty(),
            "a payment ran SQL functions as calls of their own (each planned again every transaction): {planned:?}"
        );
    }
    drop(conn);
    drop_database(&url).await;
}

#[tokio::test]
async fn results_are_recorded_by_key_even_when_the_statistics_saw_an_empty_backlog() {
    // A queue table is analysed when its backlog happens to be empty (right after a drain):
    // the planner then expects one pending row. Recording results must still look each
    // delivery up by its key, not walk every pending row of the endpoint per attempt (what
    // slowed make bench's second drain to a fifth: migrations/V12).
    let (url, mut conn) = planner_database("record_plan").await;
    let (tenant, endpoint) = (Uuid::new_v4(), Uuid::new_v4());
    insert_deliveries(&mut conn, (tenant, endpoint), 300, "delivered", 0).await;
    sqlx::query("ANALYZE webhook_deliveries")
        .execute(&mut conn)
        .await
        .unwrap();
    insert_deliveries(&mut conn, (tenant, endpoint), 2_000, "pending", 0).await;
    // As a long-lived connection runs them after five calls: one plan for any arrays.
    sqlx::query("SET plan_cache_mode = force_generic_plan")
        .execute(&mut conn)
        .await
        .unwrap();
    let picked: Vec<Uuid> = sqlx::query_scalar(
        "SELECT event_id FROM webhook_deliveries WHERE state = 'pending' ORDER BY random() LIMIT 17",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let (delivered, retried) = picked.split_at(16);
    let n = delivered.len();

    sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
    let before = delivery_fetches(&mut conn).await;
    let applied: Vec<bool> = sqlx::query_scalar(
        "SELECT applied FROM oncepay_webhook_record_many($1, $2, $3, $4, $5, $6, $7, $8, $9, 'test', $10, $11)",
    )
    .bind(vec![tenant; n])
    .bind(delivered)
    .bind(vec![endpoint; n])
    .bind(vec![0_i32; n])
    .bind(vec![chrono::Utc::now(); n])
    .bind(vec![1_i32; n])
    .bind(vec![200_i16; n])
    .bind(vec![None::<String>; n])
    .bind(vec![None::<String>; n])
    .bind(vec!["delivered"; n])
    .bind(vec![None::<chrono::DateTime<chrono::Utc>>; n])
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let many = delivery_fetches(&mut conn).await - before;
    // One result alone, another outcome (a retry): V9's one-by-one function.
    let before = delivery_fetches(&mut conn).await;
    let one: bool = sqlx::query_scalar(
        "SELECT oncepay_webhook_record($1, $2, $3, 0, now(), 1, 500::smallint, NULL, NULL, 'test', 'retry', now())",
    )
    .bind(tenant)
    .bind(retried[0])
    .bind(endpoint)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let single = delivery_fetches(&mut conn).await - before;
    sqlx::query("COMMIT").execute(&mut conn).await.unwrap();

    assert_eq!(
        (applied, one),
        (vec![true; n], true),
        "every result settled its delivery"
    );
    assert!(
        many <= 2 * n as i64,
        "{many} index fetches to record {n} deliveries: the pending rows were walked, not the key looked up"
    );
    assert!(single <= 2, "{single} index fetches to record one result");
    let settled: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE state = 'delivered'")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(settled, 300 + n as i64);
    drop(conn);
    drop_database(&url).await;
}

#[tokio::test]
async fn a_fan_out_reads_only_its_batch_however_large_the_events_table() {
    // The events table keeps a week of events, nearly all fanned out long ago. A fan-out must
    // reach its batch through the awaiting index and the rows' addresses, never by reading the
    // table (V14's join was planned as a hash join over a sequential scan, by the table's
    // statistics: 0.78 ms per event on a 31,000-row table; migrations/V15).
    let (url, mut conn) = planner_database("fan_out_plan").await;
    let (tenant, _) = tenant_with_endpoint(&mut conn).await;
    let events = |n: i32, awaiting: Option<bool>| {
        sqlx::query(
            "INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at, awaiting_fan_out)
             SELECT $1, gen_random_uuid(), 'payment.succeeded', 'pay_' || g, '{}', now(), $3
               FROM generate_series(1, $2) g",
        )
        .bind(tenant)
        .bind(n)
        .bind(awaiting)
    };
    events(5_000, None).execute(&mut conn).await.unwrap();
    sqlx::query("ANALYZE webhook_events").execute(&mut conn).await.unwrap();
    let awaiting = 40;
    events(awaiting, Some(true)).execute(&mut conn).await.unwrap();

    sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
    let fanned: i32 = sqlx::query_scalar("SELECT oncepay_webhook_fan_out(1000)")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let (seq_read, fetched) = reads(&mut conn, "webhook_events").await;
    sqlx::query("COMMIT").execute(&mut conn).await.unwrap();

    assert_eq!(fanned, awaiting, "every awaiting event fanned out");
    assert_eq!(
        seq_read, 0,
        "the fan-out read {seq_read} event rows by sequential scan to fan out {awaiting}"
    );
    assert!(
        fetched <= 2 * i64::from(awaiting),
        "{fetched} index fetches to fan out {awaiting} events"
    );
    let deliveries: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE tenant_id = $1")
        .bind(tenant)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(deliveries, i64::from(awaiting));
    drop(conn);
    drop_database(&url).await;
}

#[tokio::test]
async fn a_claim_finds_each_resources_earlier_delivery_by_its_index_even_when_the_statistics_saw_an_empty_backlog() {
    // The claim takes an endpoint's due deliveries in order, each only if no earlier delivery
    // of its resource is pending. Analysed while the backlog was empty, the planner believed
    // the endpoint's pending rows to be one and answered that check by walking them all from
    // the front, once per candidate: make bench's drains and this test's 2,000 deliveries
    // waiting for a retry ahead of the due ones (a receiver that failed, then recovered)
    // made the claim cost grow with the backlog (migrations/V16).
    let (url, mut conn) = planner_database("claim_plan").await;
    let (tenant, endpoint) = tenant_with_endpoint(&mut conn).await;
    insert_deliveries(&mut conn, (tenant, endpoint), 300, "delivered", 0).await;
    sqlx::query("ANALYZE webhook_deliveries")
        .execute(&mut conn)
        .await
        .unwrap();
    let waiting = 2_000;
    insert_deliveries(&mut conn, (tenant, endpoint), waiting, "pending", 3_600).await;
    insert_deliveries(&mut conn, (tenant, endpoint), 300, "pending", 0).await;
    // As a long-lived connection runs the claim's statements after five calls.
    sqlx::query("SET plan_cache_mode = force_generic_plan")
        .execute(&mut conn)
        .await
        .unwrap();

    let limit = 16;
    sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
    let before = delivery_fetches(&mut conn).await;
    let claimed: i64 = sqlx::query_scalar("SELECT count(*) FROM oncepay_webhook_claim_fanned_out($1, $1, 30000)")
        .bind(limit)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let fetched = delivery_fetches(&mut conn).await - before;
    sqlx::query("COMMIT").execute(&mut conn).await.unwrap();

    assert_eq!(
        claimed,
        i64::from(limit),
        "the claim took as many due deliveries as it asked for"
    );
    // Passing the waiting rows once is the scan's; each candidate's check is a probe.
    assert!(
        fetched <= i64::from(waiting + 8 * limit),
        "{fetched} index fetches to claim {limit} deliveries behind {waiting} waiting ones: \
         each candidate walked the endpoint's pending rows"
    );
    drop(conn);
    drop_database(&url).await;
}

#[tokio::test]
async fn a_claim_descends_the_pending_index_once_per_endpoint_it_visits_not_once_more_per_tenant() {
    // The claim lists each tenant's endpoints with pending deliveries by descents of the
    // pending index, one an endpoint; the descent that ends a tenant's list lands on the next
    // tenant's first row. V45 looked that row up again: one descent more a tenant, about a
    // tenth of a claim at steady load over many tenants of few endpoints (measured from
    // outside, 1.15x V39's cost a call). V46 hands it over.
    let (url, mut conn) = planner_database("claim_descents").await;
    let (tenants, endpoints) = (12, 2);
    for _ in 0..tenants {
        let (tenant, endpoint) = tenant_with_endpoint(&mut conn).await;
        insert_deliveries(&mut conn, (tenant, endpoint), 1, "pending", 0).await;
        let sibling = Uuid::new_v4();
        sqlx::query(
            "INSERT INTO webhook_endpoints (tenant_id, endpoint_id, url, secret_encrypted, created_at)
             VALUES ($1, $2, 'https://example.com/other', '\\x00', now() - interval '1 hour')",
        )
        .bind(tenant)
        .bind(sibling)
        .execute(&mut conn)
        .await
        .unwrap();
        insert_deliveries(&mut conn, (tenant, sibling), 1, "pending", 0).await;
    }

    let (claimed, descents) = claim_counting_descents(&mut conn, 100).await;

    let visited = tenants * endpoints;
    assert_eq!(
        claimed.len() as i64,
        visited,
        "one call claimed every endpoint's due delivery"
    );
    // Each endpoint visited: the descent that finds it, the count of its attempts in flight and
    // the scan that takes its deliveries (as planned without statistics); the wrap around the
    // random starting tenant: at most three more. V45 scanned 85 times here.
    assert!(
        descents <= 3 * visited + 3,
        "{descents} scans of the pending index to visit {visited} endpoints of {tenants} tenants: \
         more than one descent an endpoint"
    );
    drop(conn);
    drop_database(&url).await;
}

#[tokio::test]
async fn a_long_list_of_a_tenants_endpoints_is_claimed_whole_and_hands_over_to_the_next_tenant() {
    // Past eight endpoints with work, the claim finds the rest of a tenant's list in one
    // recursive statement (V49) instead of a statement a descent: still one descent an
    // endpoint, every endpoint visited, and the descent past a tenant's last endpoint is
    // what finds the next tenant, as the loop's was (V46).
    let (url, mut conn) = planner_database("claim_long_lists").await;
    let (tenants, endpoints) = (3, 20);
    for _ in 0..tenants {
        let (tenant, first) = tenant_with_endpoint(&mut conn).await;
        insert_deliveries(&mut conn, (tenant, first), 1, "pending", 0).await;
        for endpoint in add_endpoints(&mut conn, tenant, endpoints - 1, false).await {
            insert_deliveries(&mut conn, (tenant, endpoint), 1, "pending", 0).await;
        }
    }

    let (claimed, descents) = claim_counting_descents(&mut conn, 200).await;

    let visited = i64::from(tenants * endpoints);
    let distinct: std::collections::HashSet<_> = claimed.iter().collect();
    assert_eq!(
        (claimed.len(), distinct.len()),
        (60, 60),
        "one call claimed each endpoint's due delivery once"
    );
    // As for short lists: the descent that finds each endpoint, the count of its attempts in
    // flight and the scan that takes its deliveries; the first descent and the wrap around the
    // random starting tenant: two more. A list that did not hand its last row over would
    // cost one descent more a tenant.
    assert!(
        descents <= 3 * visited + 2,
        "{descents} scans of the pending index to visit {visited} endpoints of {tenants} tenants"
    );
    drop(conn);
    drop_database(&url).await;
}

#[tokio::test]
async fn a_claim_reads_an_endpoints_due_deliveries_not_its_backlog_of_retries() {
    // Found from outside: an endpoint down for two days held 142,617 pending deliveries, nearly
    // none due, and every claim read all of them in sequence order to find none (107 ms a
    // claim, a core of PostgreSQL for the ~31 hours of retries). Since V50 a claim reads an
    // endpoint's due deliveries by the due index, and passes one with none due by a descent.
    let (url, mut conn) = planner_database("claim_backlog").await;
    let (tenant, endpoint) = tenant_with_endpoint(&mut conn).await;
    let waiting = 3_000;
    insert_deliveries(&mut conn, (tenant, endpoint), waiting, "pending", 3_600).await;
    sqlx::query("ANALYZE webhook_deliveries")
        .execute(&mut conn)
        .await
        .unwrap();
    // As a long-lived connection runs the claim's statements after five calls.
    sqlx::query("SET plan_cache_mode = force_generic_plan")
        .execute(&mut conn)
        .await
        .unwrap();

    let (claimed, fetched) = claim_fetching(&mut conn, 16).await;
    assert_eq!(claimed.len(), 0, "nothing is due");
    assert!(
        fetched < 20,
        "{fetched} rows fetched to find nothing due among {waiting} retries"
    );

    // Five due behind them (later in sequence): those five are read, not the backlog.
    insert_deliveries(&mut conn, (tenant, endpoint), 5, "pending", 0).await;
    let (claimed, fetched) = claim_fetching(&mut conn, 16).await;
    assert_eq!(claimed.len(), 5, "the due ones are claimed");
    assert!(
        fetched < 100,
        "{fetched} rows fetched to claim 5 due deliveries behind {waiting} retries"
    );
    drop(conn);
    drop_database(&url).await;
}

#[tokio::test]
async fn deliveries_due_at_the_same_instant_are_claimed_oldest_first() {
    // A fan-out, a recovery or an enable makes many deliveries due at one instant. Taken by
    // due time alone (V50's first form), a claim took later ones first (found from outside:
    // of three due at once, the two newest); the due index orders them by sequence after.
    let (url, mut conn) = planner_database("claim_same_instant").await;
    let (tenant, endpoint) = tenant_with_endpoint(&mut conn).await;
    insert_deliveries(&mut conn, (tenant, endpoint), 40, "pending", 0).await;
    // Made due at one instant newest first, as an update can: the newest row versions then
    // stand first among equal due times in the index's own order.
    sqlx::query(
        "DO $$
         DECLARE r record; t timestamptz := now() - interval '1 second';
         BEGIN
             FOR r IN SELECT event_id FROM webhook_deliveries ORDER BY sequence DESC LOOP
                 UPDATE webhook_deliveries SET next_attempt_at = t WHERE event_id = r.event_id;
             END LOOP;
         END $$",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let oldest: Vec<Uuid> =
        sqlx::query_scalar("SELECT event_id FROM webhook_deliveries WHERE tenant_id = $1 ORDER BY sequence LIMIT 4")
            .bind(tenant)
            .fetch_all(&mut conn)
            .await
            .unwrap();
    let mut claimed: Vec<Uuid> = sqlx::query_scalar(
        "SELECT event_id FROM oncepay_webhook_claim_scheduled(4, 4, 30000, false, '{}', '{}', 4,
                                                           '{}', '{}', '{}', '{}')",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let mut expected = oldest.clone();
    claimed.sort();
    expected.sort();
    assert_eq!(claimed, expected, "the four oldest of 40 due at once");
    drop(conn);
    drop_database(&url).await;
}

/// One claim of at most `limit` deliveries, `limit` slots free and nothing in flight, committed:
/// the (tenant, endpoint) of each delivery claimed, and the scans of the pending index it made.
async fn claim_counting_descents(conn: &mut sqlx::PgConnection, limit: i32) -> (Vec<(Uuid, Uuid)>, i64) {
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    let scans = "SELECT pg_stat_get_xact_numscans('webhook_deliveries_endpoint_idx'::regclass)";
    let before: i64 = sqlx::query_scalar(scans).fetch_one(&mut *conn).await.unwrap();
    let claimed = sqlx::query_as(
        "SELECT tenant_id, endpoint_id FROM oncepay_webhook_claim_scheduled($1, 4, 30000, false, '{}', '{}', $1,
                                                                           '{}', '{}', '{}', '{}')",
    )
    .bind(limit)
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    let descents = sqlx::query_scalar::<_, i64>(scans).fetch_one(&mut *conn).await.unwrap() - before;
    sqlx::query("COMMIT").execute(&mut *conn).await.unwrap();
    (claimed, descents)
}

/// `n` more endpoints of the tenant, with time-ordered ids as the API makes them, failing
/// since an hour ago or not; their ids, oldest first.
async fn add_endpoints(conn: &mut sqlx::PgConnection, tenant: Uuid, n: i32, failing: bool) -> Vec<Uuid> {
    sqlx::query_scalar(
        "INSERT INTO webhook_endpoints (tenant_id, endpoint_id, url, secret_encrypted, created_at, failing_since)
         SELECT $1, oncepay_uuid7(), 'https://example.com/hooks/' || g, '\\x00', now() - interval '1 hour',
                CASE WHEN $3 THEN now() - interval '1 hour' END
           FROM generate_series(1, $2) g
         RETURNING endpoint_id",
    )
    .bind(tenant)
    .bind(n)
    .bind(failing)
    .fetch_all(conn)
    .await
    .map(|mut ids: Vec<Uuid>| {
        ids.sort();
        ids
    })
    .unwrap()
}

#[tokio::test]
async fn healthy_endpoints_behind_many_older_failing_ones_are_claimed_at_once() {
    // V45's promise with ids made as the API makes them (time-ordered): a tenant of 300
    // endpoints that fail, created first, and 50 healthy ones after them; the healthy ones'
    // due deliveries are claimed at once. A window over a large tenant's endpoints (V49,
    // tried and dropped before release) failed this: 0 of 150 in 50 s from outside, 0 of 50
    // in 40 claims here, as every window was the oldest endpoints.
    let (url, mut conn) = planner_database("claim_window_failing").await;
    let (tenant, first) = tenant_with_endpoint(&mut conn).await;
    insert_deliveries(&mut conn, (tenant, first), 1, "pending", 3_600).await;
    for failing in add_endpoints(&mut conn, tenant, 300, true).await {
        // A retry an hour away: pending, not due.
        insert_deliveries(&mut conn, (tenant, failing), 1, "pending", 3_600).await;
    }
    let healthy = add_endpoints(&mut conn, tenant, 50, false).await;
    for endpoint in &healthy {
        insert_deliveries(&mut conn, (tenant, *endpoint), 1, "pending", 0).await;
    }

    let (mut claimed, mut claims) = (0, 0);
    while claimed < 50 && claims < 40 {
        claims += 1;
        claimed += sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM oncepay_webhook_claim_scheduled(8, 4, 600000, false, '{}', '{}', 8,
                                                                '{}', '{}', '{}', '{}')",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
    }

    // Seven claims of 8 take them all.
    assert_eq!(
        claimed, 50,
        "the healthy endpoints' due deliveries claimed in {claims} claims of 8"
    );
    drop(conn);
    drop_database(&url).await;
}

#[tokio::test]
async fn a_claim_does_not_read_later_deliveries_waiting_behind_a_retry_of_their_resource() {
    // Found from outside: an endpoint down for days had 6,670 refunds due for hours, each
    // behind its payment waiting for a retry, and every claim read all of them, first in its
    // due order (V50), to take none: 34 ms a claim. Since V52 a later delivery of a resource
    // is due when the earlier one waiting for a retry is: put there by the record of that
    // one's failure, or written there by the fan-out.
    let (url, mut conn) = planner_database("claim_behind").await;
    let (tenant, endpoint) = tenant_with_endpoint(&mut conn).await;
    let payments = 300;
    insert_deliveries(&mut conn, (tenant, endpoint), payments, "pending", 0).await;
    sqlx::query("ANALYZE webhook_deliveries")
        .execute(&mut conn)
        .await
        .unwrap();
    // One event more of each payment's resource, fanned out now (a refund's).
    let refunds = async |conn: &mut sqlx::PgConnection| {
        sqlx::query(
            "INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at, awaiting_fan_out)
             SELECT tenant_id, gen_random_uuid(), 'payment.refunded', resource_id, '{}', now(), true
               FROM webhook_events WHERE tenant_id = $1 AND event_type = 'payment.succeeded'",
        )
        .bind(tenant)
        .execute(&mut *conn)
        .await
        .unwrap();
        let fanned: i32 = sqlx::query_scalar("SELECT oncepay_webhook_fan_out(1000)")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        assert_eq!(fanned, payments);
    };

    // The payments' attempts go out; the refunds are fanned out meanwhile, due now behind
    // attempts in flight; then every payment's attempt fails, to be retried in an hour.
    let (out, _) = claim_fetching(&mut conn, payments).await;
    assert_eq!(out.len(), payments as usize);
    refunds(&mut conn).await;
    let n = out.len();
    sqlx::query(
        "SELECT oncepay_webhook_record_many(array_fill($1::uuid, ARRAY[$3]), $2, array_fill($4::uuid, ARRAY[$3]),
                                            array_fill(1, ARRAY[$3]), array_fill(now(), ARRAY[$3]),
                                            array_fill(30, ARRAY[$3]), array_fill(500::smallint, ARRAY[$3]),
                                            array_fill(NULL::text, ARRAY[$3]), array_fill(NULL::text, ARRAY[$3]), 'test',
                                            array_fill('retry'::text, ARRAY[$3]),
                                            array_fill(now() + interval '1 hour', ARRAY[$3]))",
    )
    .bind(tenant)
    .bind(out.iter().map(|(event, _)| *event).collect::<Vec<_>>())
    .bind(i32::try_from(n).unwrap())
    .bind(endpoint)
    .execute(&mut conn)
    .await
    .unwrap();
    let (claimed, fetched) = claim_fetching(&mut conn, 16).await;
    assert!(claimed.is_empty(), "nothing is due: {claimed:?}");
    assert!(
        fetched < 50,
        "{fetched} rows fetched to find nothing due: the refunds behind failed payments were read"
    );

    // More events of those resources fanned out while the payments wait: due with them.
    refunds(&mut conn).await;
    let (claimed, fetched) = claim_fetching(&mut conn, 16).await;
    assert!(claimed.is_empty(), "nothing is due: {claimed:?}");
    assert!(
        fetched < 50,
        "{fetched} rows fetched to find nothing due: the refunds fanned out behind waiting payments were read"
    );

    // The payments' retry comes: each payment before its refunds.
    sqlx::query(
        "UPDATE webhook_deliveries SET next_attempt_at = next_attempt_at - interval '1 hour' WHERE tenant_id = $1",
    )
    .bind(tenant)
    .execute(&mut conn)
    .await
    .unwrap();
    let (claimed, _) = claim_fetching(&mut conn, 16).await;
    assert_eq!(
        claimed.iter().map(|(_, attempt)| *attempt).collect::<Vec<_>>(),
        [2; 16],
        "the payments' second attempts first"
    );
    drop(conn);
    drop_database(&url).await;
}

#[tokio::test]
async fn a_record_passes_a_later_delivery_another_transaction_holds_rather_than_wait_for_it() {
    // The record of a failure moves the later deliveries of its resource (V52), rows it does
    // not hold and which a recovery's keyed transaction or a disable may hold, locked in
    // another order: waiting for them could close a cycle. It passes such a row instead.
    let (url, mut conn) = planner_database("record_skip").await;
    let (tenant, endpoint) = tenant_with_endpoint(&mut conn).await;
    insert_deliveries(&mut conn, (tenant, endpoint), 1, "pending", 0).await;
    let (out, _) = claim_fetching(&mut conn, 1).await;
    assert_eq!(out.len(), 1);
    sqlx::query(
        "INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at, awaiting_fan_out)
         SELECT tenant_id, gen_random_uuid(), 'payment.refunded', resource_id, '{}', now(), true
           FROM webhook_events WHERE tenant_id = $1",
    )
    .bind(tenant)
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::query("SELECT oncepay_webhook_fan_out(1000)")
        .execute(&mut conn)
        .await
        .unwrap();
    // Another transaction holds the refund's delivery.
    let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT FROM webhook_deliveries WHERE tenant_id = $1 AND event_id <> $2 FOR UPDATE) l",
    )
    .bind(tenant)
    .bind(out[0].0)
    .fetch_one(&mut holder)
    .await
    .unwrap();
    assert_eq!(held, 1);

    sqlx::query("SET statement_timeout = '3s'")
        .execute(&mut conn)
        .await
        .unwrap();
    let applied: Result<bool, sqlx::Error> = sqlx::query_scalar(
        "SELECT oncepay_webhook_record($1, $2, $3, 1, now(), 30, 500::smallint, NULL, NULL, 'test', 'retry',
                                       now() + interval '1 hour')",
    )
    .bind(tenant)
    .bind(out[0].0)
    .bind(endpoint)
    .fetch_one(&mut conn)
    .await;
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();

    assert!(
        applied.as_ref().is_ok_and(|applied| *applied),
        "the record, while the refund's delivery is held: {applied:?}"
    );
    drop((conn, holder));
    drop_database(&url).await;
}
