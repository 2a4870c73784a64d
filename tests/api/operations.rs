//! Commands and operator endpoints: migrations, the schema check, tenants, health, metrics
//! and the purge.

use std::time::Duration;

use reqwest::Method;
use serde_json::json;
use sqlx::Connection;
use uuid::Uuid;

use crate::support::helpers::{
    database_url, drop_database, empty_database, metric_value, new_key, spawn_app, spawn_app_on_own_database_with,
    Answer, TestApp,
};
use crate::support::tcp_relay::TcpRelay;

#[tokio::test]
async fn migrating_twice_and_from_two_processes_at_once_is_safe() {
    let url = empty_database("migrate").await;
    let (a, b) = tokio::join!(oncepay::db::migrate(&url), oncepay::db::migrate(&url));
    let applied = a.unwrap() + b.unwrap();
    assert_eq!(
        applied,
        oncepay::db::embedded_migration_count(),
        "each migration applied exactly once between the two"
    );
    assert_eq!(oncepay::db::migrate(&url).await.unwrap(), 0);
    drop_database(&url).await;
}

/// Found from outside (a rollout probe): a build's `oncepay migrate` on a schema a later build
/// had migrated failed ("migration V34 ... is missing from the filesystem", exit 1), so a
/// replica of the previous version whose start-up runs `migrate` before `serve` could neither
/// restart during the rollout nor be rolled back to. Now it applies nothing and succeeds when
/// every migration it has is applied as it has it, and refuses, naming it, when one is not.
#[tokio::test]
async fn migrate_on_a_schema_a_later_build_migrated_applies_nothing_and_succeeds() {
    let url = empty_database("ahead").await;
    oncepay::db::migrate(&url).await.unwrap();
    let later = oncepay::db::expected_schema_version() + 1;
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query(
        "INSERT INTO refinery_schema_history (version, name, applied_on, checksum)
         VALUES ($1, 'a_later_build', '2026-12-06T21:00:00Z', '1')",
    )
    .bind(later)
    .execute(&mut conn)
    .await
    .unwrap();

    assert_eq!(oncepay::db::migrate(&url).await.unwrap(), 0, "nothing to apply");
    let served = TestApp::builder()
        .settings(|s| s.database_url = url.clone())
        .try_spawn()
        .await;
    assert!(served.is_ok(), "serve starts on it too: {:?}", served.err());

    // One of this build's migrations applied with other contents: refused, named.
    sqlx::query("UPDATE refinery_schema_history SET checksum = '1' WHERE version = 1")
        .execute(&mut conn)
        .await
        .unwrap();
    let refused = format!("{:#}", oncepay::db::migrate(&url).await.unwrap_err());
    assert!(refused.contains("V1 was applied with other contents"), "{refused}");
    drop(conn);
    drop_database(&url).await;
}

#[tokio::test]
async fn serve_refuses_a_schema_that_is_behind_and_names_the_fix() {
    let url = empty_database("behind").await;

    let refused = TestApp::builder()
        .settings(|s| s.database_url = url.clone())
        .try_spawn()
        .await;

    let message = format!("{:#}", refused.err().expect("serve must refuse"));
    assert!(message.contains("oncepay migrate"), "{message}");
    assert!(!message.contains('\n'), "one line: {message}");
    drop_database(&url).await;
}

#[tokio::test]
async fn the_admin_api_creates_tenants_whose_keys_work() {
    let app = spawn_app().await;
    let created = app
        .admin(
            Method::POST,
            "/admin/tenants",
            Some(&json!({ "name": "shop", "missing_key_policy": "allow", "main_balance": 42 })),
        )
        .await;
    assert_eq!(created.status, 201, "{}", created.body);
    assert_eq!(created.body["name"], "shop");
    assert_eq!(created.body["missing_key_policy"], "allow");
    let api_key = created.body["api_key"].as_str().unwrap();

    let account = app.get_as(api_key, "/accounts/main").await;
    assert_eq!(
        (&account.body["id"], &account.body["balance"]),
        (&json!("main"), &json!(42))
    );
    assert!(account.body["created_at"].is_string(), "{}", account.body);
    let bad = app
        .admin(Method::POST, "/admin/tenants", Some(&json!({ "name": "" })))
        .await;
    bad.assert_problem(400, "invalid_request");
}

#[tokio::test]
async fn health_and_readiness_answer() {
    let app = spawn_app().await;
    assert_eq!(app.client.get(app.url("/healthz")).send().await.unwrap().status(), 200);
    assert_eq!(app.client.get(app.url("/readyz")).send().await.unwrap().status(), 200);
}

/// HEAD answers as GET does, without the content (found from outside: a balancer's HEAD
/// health check got 404), on the probes and on the API's reads; an unknown path stays 404.
#[tokio::test]
async fn head_answers_as_get_without_the_content() {
    let app = spawn_app().await;
    for path in ["/healthz", "/readyz", "/openapi.json"] {
        let head = app.client.head(app.url(path)).send().await.unwrap();
        assert_eq!(head.status(), 200, "{path}");
        assert!(head.bytes().await.unwrap().is_empty(), "{path}: no content");
    }
    let get = app
        .client
        .get(app.url("/accounts/main"))
        .bearer_auth(&app.api_key)
        .send()
        .await
        .unwrap();
    let length = get.headers()["content-length"].clone();
    let head = app
        .client
        .head(app.url("/accounts/main"))
        .bearer_auth(&app.api_key)
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), 200);
    assert_eq!(head.headers()["content-length"], length, "the GET's length");
    assert!(head.bytes().await.unwrap().is_empty());
    let unauthenticated = app.client.head(app.url("/accounts/main")).send().await.unwrap();
    assert_eq!(unauthenticated.status(), 401);
    let unknown = app.client.head(app.url("/nowhere")).send().await.unwrap();
    assert_eq!(unknown.status(), 404);
}

#[tokio::test]
async fn readiness_is_503_when_the_database_is_unreachable() {
    // The database lost after start (one not reached yet: tests/api/startup.rs): the server
    // reaches it through a relay, which is cut once it is ready.
    let (relay, url) = TcpRelay::in_front_of(&database_url()).await;
    let app = TestApp::builder()
        .settings(|s| {
            s.database_url = url;
            s.db_acquire_timeout = Duration::from_millis(500);
        })
        .spawn()
        .await;
    let readyz = || async { Answer::from(app.client.get(app.url("/readyz")).send().await.unwrap()).await };
    let ready = readyz().await;
    assert_eq!((ready.status, &ready.body), (200, &json!({ "status": "ready" })));

    relay.cut().await;

    // First on the pooled connection the cut closed, then on the closed port.
    for attempt in 1..=2 {
        let unready = readyz().await;
        unready.assert_problem(503, "temporarily_unavailable");
        assert_eq!(unready.header("retry-after"), Some("1"), "attempt {attempt}");
    }
    let alive = app.client.get(app.url("/healthz")).send().await.unwrap();
    assert_eq!(alive.status(), 200, "the process still runs");
    // The probes' 503s are counted under their route, not as error answers to clients: a
    // load balancer's probes alone must not make the error rate that pages.
    let metrics = app.metrics().await;
    assert!(
        metric_value(
            &metrics,
            r#"oncepay_requests_total{outcome="transient_error",route="/readyz"}"#
        ) >= 2.0,
        "{metrics}"
    );
    assert_eq!(
        metric_value(&metrics, r#"oncepay_errors_total{code="temporarily_unavailable"}"#),
        0.0,
        "{metrics}"
    );
}

/// A database that stops answering without closing anything (a network partition, a frozen
/// host): PostgreSQL's statement timeout cannot fire on what never reaches it, so the server
/// bounds its own wait, answers 503 (the outcome unknown: the statement may still arrive and
/// commit), and closes the silent connection; once the database answers again, the retry
/// with the key charges once, whichever of the two reached it first.
#[tokio::test]
async fn a_database_that_stops_answering_is_answered_within_the_statement_timeout_and_a_margin() {
    let (relay, url) = TcpRelay::in_front_of(&database_url()).await;
    let app = TestApp::builder()
        .settings(|s| {
            s.database_url = url;
            s.statement_timeout = Duration::from_secs(1);
            s.db_acquire_timeout = Duration::from_millis(500);
        })
        .spawn()
        .await;
    let paid = app.pay(Some(&new_key()), 10).await;
    assert_eq!(paid.status, 201, "{}", paid.body);
    let id = paid.body["id"].as_str().unwrap().to_owned();

    relay.silence();
    let key = new_key();
    // 1 s of statement timeout and the 5 s margin; far less than a kernel's wait on a socket.
    let bound = Duration::from_secs(12);
    let started = std::time::Instant::now();
    let silent = tokio::time::timeout(bound, app.pay(Some(&key), 20))
        .await
        .expect("a payment is answered while the database is silent");
    silent.assert_problem(503, "temporarily_unavailable");
    let read = tokio::time::timeout(bound, app.get(&format!("/payments/{id}")))
        .await
        .expect("a read is answered while the database is silent");
    assert!(
        matches!(read.status, 429 | 503),
        "a read with no database is refused as for now: {} {}",
        read.status,
        read.body
    );
    assert!(started.elapsed() < 2 * bound, "{:?}", started.elapsed());

    relay.resume();
    let mut retried = app.pay(Some(&key), 20).await;
    for _ in 0..50 {
        if retried.status != 503 && retried.status != 409 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        retried = app.pay(Some(&key), 20).await;
    }
    assert_eq!(retried.status, 201, "{}", retried.body);
    let charged: i64 =
        sqlx::query_scalar("SELECT count(*) FROM payments WHERE tenant_id = $1 AND idempotency_key = $2")
            .bind(app.tenant_id)
            .bind(&key)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(charged, 1, "charged once");
    let metrics = app.metrics().await;
    assert!(
        metric_value(&metrics, r#"oncepay_db_connections_closed_total{reason="broken"}"#) >= 1.0,
        "the silent connection was closed: {metrics}"
    );
}

/// Found from outside: while PgBouncer held every query (`PAUSE`), `/readyz` answered 200 only
/// when the pause ended (8 s later), and 1 s probes got no answer at all for 20 s. A probe
/// waits for the database at most `db::PROBE_WITHIN` (2 s), then says 503, and the scrape
/// says `oncepay_ready 0`; once the database answers again, both are ready.
#[tokio::test]
async fn readiness_is_answered_within_its_bound_while_the_database_holds_the_query() {
    let (relay, url) = TcpRelay::in_front_of(&database_url()).await;
    let app = TestApp::builder()
        .settings(|s| {
            s.database_url = url;
            s.statement_timeout = Duration::from_secs(30);
        })
        .spawn()
        .await;
    let readyz = |base: &str| format!("{base}/readyz");
    let probe = |url: String| {
        let client = app.client.clone();
        async move {
            let started = std::time::Instant::now();
            let status = client
                .get(url)
                .timeout(Duration::from_secs(10))
                .send()
                .await
                .map(|r| r.status().as_u16());
            (status.ok(), started.elapsed())
        }
    };
    assert_eq!(probe(readyz(&app.address)).await.0, Some(200));

    relay.silence();
    for base in [&app.address, &app.operations_address] {
        let (status, took) = probe(readyz(base)).await;
        assert_eq!(status, Some(503), "{base} after {took:?}");
        assert!(took < Duration::from_secs(4), "{base}: {took:?}");
    }
    let started = std::time::Instant::now();
    let metrics = app.metrics().await;
    assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
    assert_eq!(metric_value(&metrics, "oncepay_ready"), 0.0, "{metrics}");

    relay.resume();
    let mut status = None;
    for _ in 0..50 {
        status = probe(readyz(&app.address)).await.0;
        if status == Some(200) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(status, Some(200), "ready again once the database answers");
}

/// Found from outside: the scrape's probe asked the key table where `/readyz` asks whether a
/// writable primary answers, so a lock on that one table read `oncepay_ready 0` beside
/// `/readyz`'s 200 for 25 s (and a read-only database 1 beside 503: failover.rs). A lock on a
/// table is not a database that is down; the key age keeps its last value meanwhile.
#[tokio::test]
async fn a_lock_on_the_key_table_leaves_the_scrape_ready_as_readyz_is() {
    let (app, url) = spawn_app_on_own_database_with("ready_lock", |_| {}).await;
    assert_eq!(metric_value(&app.metrics().await, "oncepay_ready"), 1.0);
    let mut locker = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut locker).await.unwrap();
    sqlx::query("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
        .execute(&mut locker)
        .await
        .unwrap();

    let started = std::time::Instant::now();
    let metrics = app.metrics().await;
    let took = started.elapsed();
    let readyz = app
        .client
        .get(format!("{}/readyz", app.address))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16();
    sqlx::query("ROLLBACK").execute(&mut locker).await.unwrap();

    assert_eq!(readyz, 200, "a writable primary answers");
    assert_eq!(metric_value(&metrics, "oncepay_ready"), 1.0, "{metrics}");
    assert!(took < Duration::from_secs(4), "the scrape took {took:?}");
    drop(locker);
    app.state.db.close().await;
    drop_database(&url).await;
}

#[tokio::test]
async fn metrics_count_a_new_request_and_its_replay_apart() {
    let app = spawn_app().await;
    let key = new_key();
    app.pay(Some(&key), 100).await;
    app.pay(Some(&key), 100).await;

    let text = app.metrics().await;

    assert!(
        text.contains(r#"oncepay_requests_total{outcome="created",route="/payments"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"oncepay_requests_total{outcome="replayed",route="/payments"} 1"#),
        "{text}"
    );
    let replays_of_tenant = format!(r#"oncepay_replays_total{{tenant="{}"}}"#, app.tenant_id);
    // Both requests timed; nothing purged, no request waiting for a connection, the
    // pool's size as configured (10 in the test settings) and the list pool's a quarter of it.
    for (series, value) in [
        (r#"oncepay_request_duration_seconds_count{route="/payments"}"#, 2.0),
        (replays_of_tenant.as_str(), 1.0),
        ("oncepay_purged_keys_total", 0.0),
        ("oncepay_db_pool_waiting", 0.0),
        (r#"oncepay_db_pool_connections{state="max"}"#, 10.0),
        (r#"oncepay_db_list_pool_connections{state="max"}"#, 2.0),
    ] {
        assert!(
            text.lines().any(|line| line.starts_with(series)),
            "{series} is exposed:\n{text}"
        );
        assert_eq!(metric_value(&text, series), value, "{series}:\n{text}");
    }
}

/// Contract 6b: `not_found` is "a read or refund of an unknown resource", `declined` any
/// other stored deterministic failure; their replays are `replayed`.
#[tokio::test]
async fn metrics_count_a_refund_of_an_unknown_payment_as_not_found() {
    let app = spawn_app().await;
    let unknown = Uuid::new_v4().to_string();
    let key = new_key();
    app.refund(Some(&key), &unknown).await.assert_problem(404, "not_found");
    app.refund(Some(&key), &unknown).await.assert_problem(404, "not_found");
    let paid = app.pay(Some(&new_key()), 100).await;
    let id = paid.body["id"].as_str().unwrap();
    assert_eq!(app.refund(Some(&new_key()), id).await.status, 200);
    app.refund(Some(&new_key()), id)
        .await
        .assert_problem(409, "already_refunded");

    let text = app.metrics().await;

    let route = "/payments/{id}/refund";
    for (outcome, value) in [
        ("not_found", 1.0),
        ("replayed", 1.0),
        ("declined", 1.0),
        ("created", 1.0),
    ] {
        let series = format!(r#"oncepay_requests_total{{outcome="{outcome}",route="{route}"}}"#);
        assert_eq!(metric_value(&text, &series), value, "{series}:\n{text}");
    }
}

#[tokio::test]
async fn keyless_metrics_and_request_ids_are_reported() {
    let app = spawn_app().await;
    app.set_policy("allow").await;
    let by_tenant = format!(r#"oncepay_keyless_requests_total{{tenant="{}"}}"#, app.tenant_id);
    let by_outcome = r#"oncepay_requests_total{outcome="keyless",route="/payments"}"#;
    let before = app.metrics().await;

    let response = app
        .client
        .post(app.url("/payments"))
        .bearer_auth(&app.api_key)
        .header("x-request-id", "trace-me-123")
        .json(&json!({ "amount": 100 }))
        .send()
        .await
        .unwrap();

    assert_eq!(response.headers().get("x-request-id").unwrap(), "trace-me-123");
    let answer = Answer::from(response).await;
    assert_eq!(answer.status, 201, "{}", answer.body);
    let after = app.metrics().await;
    for series in [by_tenant.as_str(), by_outcome] {
        let increase = metric_value(&after, series) - metric_value(&before, series);
        assert_eq!(increase, 1.0, "{series} after one keyless request:\n{after}");
    }
}

#[tokio::test]
async fn the_overview_view_tells_live_expired_and_due_for_purge_keys_apart() {
    let app = spawn_app().await;
    let keys: Vec<String> = (0..3).map(|_| new_key()).collect();
    let mut payment_ids = Vec::new();
    for key in &keys {
        payment_ids.push(app.pay(Some(key), 1).await.body["id"].as_str().unwrap().to_owned());
    }
    // Ages under the default retention, so that no parallel test's purge takes these rows;
    // the session's retention (which the view reads) makes the oldest one due for purge.
    for (key, age) in [(&keys[1], "25 hours"), (&keys[2], "3 days")] {
        sqlx::query(&format!(
            "UPDATE idempotency_keys SET created_at = now() - interval '{age}', expires_at = now() - interval '{age}' + interval '1 day' WHERE tenant_id = $1 AND key = $2"
        ))
        .bind(app.tenant_id)
        .bind(key)
        .execute(&app.pool)
        .await
        .unwrap();
    }
    let mut conn = app.pool.acquire().await.unwrap();
    sqlx::query("SET oncepay.retention_secs = '172800'")
        .execute(&mut *conn)
        .await
        .unwrap();

    let rows: Vec<(String, String, Option<String>, f64)> = sqlx::query_as(
        "SELECT key, state, resource_id, extract(epoch FROM replay_remaining)::float8
           FROM idempotency_key_overview WHERE tenant_id = $1",
    )
    .bind(app.tenant_id)
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    sqlx::query("RESET oncepay.retention_secs")
        .execute(&mut *conn)
        .await
        .unwrap();

    let state_of = |key: &String| rows.iter().find(|r| &r.0 == key).unwrap();
    assert_eq!(state_of(&keys[0]).1, "live");
    assert!(state_of(&keys[0]).3 > 86_000.0);
    assert_eq!(state_of(&keys[0]).2.as_ref(), Some(&payment_ids[0]));
    assert_eq!(state_of(&keys[1]).1, "expired");
    assert_eq!(state_of(&keys[1]).3, 0.0);
    assert_eq!(state_of(&keys[2]).1, "due_for_purge");
}

/// The metrics name every tenant: they are served on the operations listener
/// (`ONCEPAY_METRICS_BIND`) only; the API listener answers `/metrics` with a 404 problem and
/// keeps the probes that load balancers use.
#[tokio::test]
async fn metrics_are_served_on_the_operations_listener_only() {
    let app = spawn_app().await;
    assert_eq!(app.pay(Some(&new_key()), 1).await.status, 201);
    let get = |url: String| {
        let client = app.client.clone();
        async move { client.get(url).send().await.unwrap() }
    };

    let on_api = Answer::from(get(app.url("/metrics")).await).await;
    on_api.assert_problem(404, "not_found");
    for probe in ["/healthz", "/readyz"] {
        assert_eq!(get(app.url(probe)).await.status(), 200, "API {probe}");
        assert_eq!(
            get(format!("{}{probe}", app.operations_address)).await.status(),
            200,
            "operations {probe}"
        );
    }
    let scraped = get(format!("{}/metrics", app.operations_address)).await;
    assert_eq!(scraped.status(), 200);
    let text = scraped.text().await.unwrap();
    assert!(text.contains("oncepay_requests_total{"), "{text}");
    let elsewhere = Answer::from(get(format!("{}/payments", app.operations_address)).await).await;
    elsewhere.assert_problem(404, "not_found");
}
