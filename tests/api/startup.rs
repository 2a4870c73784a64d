//! `serve` started while its database is away (docs/operations.md, start-up while the database
//! is away): it binds and answers at once, `/healthz` 200, `/readyz` and every other call 503
//! with `Retry-After`, retries with backoff for as long as it takes, and serves once the
//! database answers. Only a schema behind the binary stops it. The database is reached through
//! a peer the test switches (`db_peer`): first it closes every connection (PostgreSQL down) or
//! refuses the login as PgBouncer does after a failed server login, then it relays to the test
//! cluster.

use std::time::Duration;

use oncepay::domain::MissingKeyPolicy;
use oncepay::startup::Application;
use reqwest::Method;
use serde_json::json;
use sqlx::postgres::PgPoolOptions;

use crate::support::db_peer::{DatabasePeer, Mode};
use crate::support::helpers::{
    database_url, documented_endpoints, drop_database, empty_database, fill, metric_value, migrate_once, new_key,
    new_tenant, test_settings, Answer, TestApp, ADMIN_TOKEN, MAIN_BALANCE,
};

/// How long a server whose database came back may take to be ready: its longest wait
/// between two attempts, and the attempt.
const READY_AFTER_THE_DATABASE: Duration = Duration::from_secs(20);

/// A tenant made on the test database directly (the server may not reach it yet).
async fn tenant_of_the_test_database() -> (uuid::Uuid, String) {
    migrate_once().await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&database_url())
        .await
        .unwrap();
    let tenant = new_tenant(&pool, MissingKeyPolicy::Reject).await;
    pool.close().await;
    tenant
}

/// A server on `url` (through the peer) that does not wait to be ready.
async fn spawn_on(url: String, tenant: (uuid::Uuid, String)) -> TestApp {
    TestApp::builder()
        .settings(|s| {
            s.database_url = url;
            s.db_acquire_timeout = Duration::from_millis(500);
        })
        .with_tenant(tenant.0, tenant.1)
        .spawn_unready()
        .await
}

async fn get(app: &TestApp, url: String) -> Answer {
    Answer::from(app.client.get(url).send().await.expect("the server answers")).await
}

/// Asserts the answer of a server that has not reached its database: 503, to retry.
#[track_caller]
fn assert_not_ready(answer: &Answer, what: &str) {
    assert_eq!(answer.status, 503, "{what}: {}", answer.body);
    answer.assert_problem(503, "temporarily_unavailable");
    assert_eq!(answer.header("retry-after"), Some("1"), "{what}");
}

/// Polls `/readyz` until it answers 200, at most [`READY_AFTER_THE_DATABASE`].
async fn wait_until_ready(app: &TestApp) {
    let mut last = None;
    let ready = tokio::time::timeout(READY_AFTER_THE_DATABASE, async {
        loop {
            let answer = get(app, app.url("/readyz")).await;
            if answer.status == 200 {
                return;
            }
            last = Some(answer.body);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        ready.is_ok(),
        "not ready {READY_AFTER_THE_DATABASE:?} after the database came back: {last:?}"
    );
}

#[tokio::test]
async fn a_server_started_while_its_database_is_down_answers_503_then_serves_once_it_connects() {
    let tenant = tenant_of_the_test_database().await;
    let peer = DatabasePeer::start(Mode::Closes).await;
    let app = spawn_on(peer.url_to(&database_url()), tenant.clone()).await;

    // Alive on both listeners, not ready, and the payment refused with a 503 to retry.
    for base in [&app.address, &app.operations_address] {
        assert_eq!(get(&app, format!("{base}/healthz")).await.status, 200, "{base}");
        assert_not_ready(&get(&app, format!("{base}/readyz")).await, "/readyz");
    }
    let key = new_key();
    assert_not_ready(&app.pay(Some(&key), 100).await, "POST /payments");
    let metrics = app.metrics().await;
    assert_eq!(metric_value(&metrics, "oncepay_ready"), 0.0, "{metrics}");
    // It keeps trying, with backoff (the first waits are 100 to 200 ms, then longer).
    peer.wait_for_attempts(3, Duration::from_secs(10)).await;
    assert_eq!(get(&app, app.url("/healthz")).await.status, 200, "still running");

    peer.switch(Mode::Relays);
    wait_until_ready(&app).await;

    let paid = app.pay(Some(&key), 100).await;
    assert_eq!((paid.status, paid.replayed()), (201, false), "{}", paid.body);
    let pool = sqlx::PgPool::connect(&database_url()).await.unwrap();
    let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE tenant_id = $1 AND account_id = 'main'")
        .bind(tenant.0)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(balance, MAIN_BALANCE - 100, "charged once");
    assert_eq!(metric_value(&app.metrics().await, "oncepay_ready"), 1.0);
}

#[tokio::test]
async fn before_its_database_answers_every_endpoint_but_the_probes_and_the_document_is_503() {
    let tenant = tenant_of_the_test_database().await;
    let peer = DatabasePeer::start(Mode::Closes).await;
    let app = spawn_on(peer.url_to(&database_url()), tenant.clone()).await;

    for (method, template) in documented_endpoints() {
        if matches!(template.as_str(), "/healthz" | "/openapi.json" | "/metrics") {
            continue;
        }
        let path = fill(
            &template,
            if template.starts_with("/accounts/") {
                "main".to_owned()
            } else if template.starts_with("/admin/tenants/") {
                tenant.0.to_string()
            } else {
                uuid::Uuid::new_v4().to_string()
            }
            .as_str(),
        );
        let token = if path.starts_with("/admin") {
            ADMIN_TOKEN
        } else {
            &tenant.1
        };
        let mut request = app.client.request(method.clone(), app.url(&path)).bearer_auth(token);
        if method == Method::POST || method == Method::PATCH {
            request = request
                .header("Idempotency-Key", new_key())
                .json(&json!({ "amount": 1 }));
        }
        let answer = Answer::from(request.send().await.unwrap()).await;
        assert_not_ready(&answer, &format!("{method} {path}"));
    }
    assert_eq!(get(&app, app.url("/openapi.json")).await.status, 200);
    assert_eq!(get(&app, app.url("/healthz")).await.status, 200);
}

#[tokio::test]
async fn a_server_whose_pooler_refuses_logins_keeps_retrying_and_serves_once_let_in() {
    let tenant = tenant_of_the_test_database().await;
    let peer = DatabasePeer::start(Mode::RefusesLogins).await;
    let app = spawn_on(peer.url_to(&database_url()), tenant).await;

    peer.wait_for_attempts(3, Duration::from_secs(10)).await;
    assert_eq!(get(&app, app.url("/healthz")).await.status, 200, "still running");
    assert_not_ready(&get(&app, app.url("/readyz")).await, "/readyz");
    assert_not_ready(&app.pay(Some(&new_key()), 5).await, "POST /payments");

    peer.switch(Mode::Relays);
    wait_until_ready(&app).await;

    let paid = app.pay(Some(&new_key()), 5).await;
    assert_eq!(paid.status, 201, "{}", paid.body);
}

#[tokio::test]
async fn serve_stops_with_the_line_naming_migrate_when_the_database_it_reaches_is_behind() {
    let url = empty_database("startbehind").await;
    let peer = DatabasePeer::start(Mode::Closes).await;
    let mut settings = test_settings();
    settings.database_url = peer.url_to(&url);
    let app = Application::build(settings).expect("serve binds without its database");
    let health = format!("http://127.0.0.1:{}/healthz", app.port());
    let serving = tokio::spawn(app.run_until_stopped());
    peer.wait_for_attempts(2, Duration::from_secs(10)).await;
    assert_eq!(reqwest::get(&health).await.unwrap().status(), 200, "running meanwhile");

    peer.switch(Mode::Relays);
    let stopped = tokio::time::timeout(READY_AFTER_THE_DATABASE, serving)
        .await
        .expect("serve stops once it reads the schema's version")
        .unwrap();

    let message = format!("{:#}", stopped.expect_err("a schema behind stops serve"));
    assert!(message.contains("oncepay migrate"), "{message}");
    assert!(!message.contains('\n'), "one line: {message}");
    assert!(reqwest::get(&health).await.is_err(), "the listener is closed");
    drop(peer);
    drop_database(&url).await;
}

#[tokio::test]
async fn the_serve_command_outlives_a_database_that_is_down_logs_each_attempt_and_stops_on_sigterm() {
    use tokio::io::AsyncBufReadExt;
    let peer = DatabasePeer::start(Mode::Closes).await;
    let mut server = tokio::process::Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .arg("serve")
        .env("DATABASE_URL", peer.url_to(&database_url()))
        .env("ONCEPAY_BIND", "127.0.0.1:0")
        .env("ONCEPAY_METRICS_BIND", "127.0.0.1:0")
        .env("ONCEPAY_LOG_FORMAT", "json")
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(server.stderr.take().unwrap()).lines();
    let mut logs = Vec::new();
    let port = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            let log: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            logs.push(log.clone());
            if log["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("oncepay listening"))
            {
                return log["port"].as_u64().unwrap();
            }
        }
        panic!("serve exited before listening: {logs:?}");
    })
    .await
    .expect("serve binds within 30 s");
    let logged = tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            logs.push(serde_json::from_str(&line).unwrap_or_default());
        }
        logs
    });

    peer.wait_for_attempts(4, Duration::from_secs(10)).await;
    let client = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    assert_eq!(
        client.get(format!("{base}/healthz")).send().await.unwrap().status(),
        200
    );
    assert_eq!(client.get(format!("{base}/readyz")).send().await.unwrap().status(), 503);
    assert!(server.try_wait().unwrap().is_none(), "serve still runs");

    crate::commands::sigterm(&server);
    let status = tokio::time::timeout(Duration::from_secs(20), server.wait())
        .await
        .expect("serve stops within 20 s of SIGTERM")
        .unwrap();
    assert_eq!(status.code(), Some(0), "a clean stop");

    let logs = logged.await.unwrap();
    // Of the database, one warning per attempt (the pool's own about the connection is not
    // repeated); others (an unset webhook secret key) are not this test's.
    let warnings: Vec<&serde_json::Value> = logs
        .iter()
        .filter(|l| l["level"] == "WARN" && l["target"].as_str().unwrap().starts_with("oncepay::db"))
        .collect();
    let attempts: Vec<&serde_json::Value> = warnings
        .iter()
        .copied()
        .filter(|l| l["message"] == "the database is not ready; serving 503 until it is")
        .collect();
    assert!(attempts.len() >= 3, "one line per failed attempt: {logs:?}");
    assert_eq!(
        attempts.len(),
        warnings.len(),
        "nothing else of the database: {warnings:?}"
    );
    for (n, line) in attempts.iter().enumerate() {
        assert_eq!(line["attempt"], n + 1, "{line}");
        assert!(line["retry_in_ms"].as_u64().unwrap() <= 5_000, "{line}");
        assert!(
            line["error"]
                .as_str()
                .unwrap()
                .starts_with("cannot reach the database at DATABASE_URL: "),
            "{line}"
        );
    }
}

/// A `serve` process (RUST_LOG=info, stderr read) that reaches the test database through a
/// relay the test can cut or silence, with `env` added; returned once it is ready, with its
/// API port.
async fn serve_through_relay(
    env: &[(&str, String)],
) -> (
    crate::support::tcp_relay::TcpRelay,
    u16,
    tokio::process::Child,
    tokio::task::JoinHandle<String>,
) {
    let (relay, url) = crate::support::tcp_relay::TcpRelay::in_front_of(&database_url()).await;
    let port = crate::commands::free_port();
    let mut all = vec![
        ("DATABASE_URL", url),
        ("ONCEPAY_BIND", format!("127.0.0.1:{port}")),
        ("ONCEPAY_METRICS_BIND", "127.0.0.1:0".to_owned()),
        ("RUST_LOG", "info".to_owned()),
    ];
    all.extend(env.iter().cloned());
    let (server, logs) = crate::commands::serve_logged(&all);
    crate::commands::wait_until_ready(&reqwest::Client::new(), port).await;
    (relay, port, server, logs)
}

/// Found from outside: every malformed request head (any client's) wrote an ERROR line of
/// actix-http's dispatcher; its problem answer is all there is to it (docs/api.md, framing).
#[tokio::test]
async fn a_malformed_request_head_is_answered_and_writes_no_error_line() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // No deliverer: on the shared database other tests' endpoints log lines of their own.
    let (_relay, port, mut server, logs) =
        serve_through_relay(&[("ONCEPAY_WEBHOOK_CONCURRENCY", "0".to_owned())]).await;
    for head in [
        "GET / HTTP/1.1\r\nBad Header\r\n\r\n",
        "GET / HTTP/9.9\r\nHost: x\r\n\r\n",
    ] {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
            .await
            .expect("answered and closed")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    }
    let logs = crate::commands::stop_logged(&mut server, logs).await;
    assert!(!logs.contains("ERROR"), "{logs}");
}

/// SIGTERM while the database takes what is sent and answers nothing (a network partition):
/// the background work's calls are bounded like a request's (the statement timeout and a
/// margin), so the process stops instead of waiting for the database to answer again.
#[tokio::test]
async fn serve_stops_on_sigterm_while_the_database_answers_nothing() {
    let (relay, _, mut server, logs) = serve_through_relay(&[
        ("ONCEPAY_STATEMENT_TIMEOUT_MS", "1000".to_owned()),
        ("ONCEPAY_INFLIGHT_WAIT_MS", "500".to_owned()),
        // On the shared database other tests' deliveries are due: this process attempts
        // some, and the stop gives their recording the attempt timeout, 1 s and 5 s (7 s
        // here, 21 s with the default 15 s timeout) before it leaves them to their leases.
        ("ONCEPAY_WEBHOOK_TIMEOUT_MS", "1000".to_owned()),
    ])
    .await;

    relay.silence();
    // The deliverer looks for due deliveries every 250 ms: its next claim is sent and held.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    crate::commands::sigterm(&server);
    let stopped = tokio::time::timeout(Duration::from_secs(15), server.wait()).await;
    relay.resume();
    let Ok(status) = stopped else {
        let logs = crate::commands::stop_logged(&mut server, logs).await;
        panic!("serve did not stop within 15 s of SIGTERM while the database answered nothing:\n{logs}");
    };
    let status = status.unwrap();
    assert_eq!(status.code(), Some(0), "a clean stop");
    let logs = logs.await.unwrap();
    assert!(logs.contains("SIGTERM"), "{logs}");
}

/// A database away while requests keep coming: each request's own line says 503, and the
/// cause is written once, not once a request (20 payments wrote 40 WARN lines besides their
/// own); the line a request wrote on its way carries its request id.
#[tokio::test]
async fn a_database_outage_is_logged_once_an_interval_not_once_a_request() {
    let app = crate::support::helpers::spawn_app().await;
    let (relay, port, mut server, logs) = serve_through_relay(&[
        ("ONCEPAY_LOG_FORMAT", "json".to_owned()),
        ("ONCEPAY_WEBHOOK_CONCURRENCY", "0".to_owned()),
    ])
    .await;
    let client = reqwest::Client::new();
    relay.cut().await;

    let base = format!("http://127.0.0.1:{port}");
    let read = client
        .get(format!("{base}/accounts/main"))
        .bearer_auth(&app.api_key)
        .header("x-request-id", "outage-1")
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), 503);
    for i in 0..20 {
        let paid = client
            .post(format!("{base}/payments"))
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", format!("outage-{i}-{}", uuid::Uuid::new_v4()))
            .json(&json!({ "amount": 1 }))
            .send()
            .await
            .unwrap();
        assert_eq!(paid.status(), 503, "payment {i}");
    }
    let logs = crate::commands::stop_logged(&mut server, logs).await;
    let entries: Vec<serde_json::Value> = logs.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let warnings: Vec<&serde_json::Value> = entries
        .iter()
        .filter(|e| e["level"] == "WARN" && e["message"] != "request")
        .collect();
    let failed: Vec<&serde_json::Value> = entries
        .iter()
        .filter(|e| e["message"] == "request" && e["status"] == 503 && e["route"] != "/readyz")
        .collect();
    assert_eq!(failed.len(), 21, "each request's own line: {logs}");
    assert!(
        warnings.len() <= 4,
        "the cause once an interval, not once a request: {} lines: {warnings:#?}",
        warnings.len()
    );
    assert!(
        entries
            .iter()
            .any(|e| e["level"] != "INFO" && e["span"]["request_id"] == "outage-1"),
        "the line the request wrote carries its id: {logs}"
    );
}

/// A payment of 5 from account `held` (balance 100) sent to a `serve` process of its own,
/// waiting on the row lock `lock` holds.
struct HeldPayment {
    app: TestApp,
    server: tokio::process::Child,
    logs: tokio::task::JoinHandle<String>,
    ops: u16,
    lock: sqlx::PgConnection,
    key: String,
    answer: tokio::task::JoinHandle<reqwest::Result<reqwest::Response>>,
}

impl HeldPayment {
    async fn send() -> Self {
        use crate::commands::{free_port, serve_logged, wait_until_ready};
        let app = crate::support::helpers::spawn_app().await;
        app.open_account("held", 100).await;
        let (port, ops) = (free_port(), free_port());
        let (server, logs) = serve_logged(&[
            ("DATABASE_URL", database_url()),
            ("ONCEPAY_BIND", format!("127.0.0.1:{port}")),
            ("ONCEPAY_METRICS_BIND", format!("127.0.0.1:{ops}")),
            ("ONCEPAY_WEBHOOK_CONCURRENCY", "0".to_owned()),
            // Direct sessions, also under `make test-pgbouncer` (its DATABASE_URL is direct).
            ("ONCEPAY_DB_POOLER", "none".to_owned()),
        ]);
        wait_until_ready(&app.client, port).await;
        let lock = crate::concurrency::lock_account_at(&database_url(), app.tenant_id, "held").await;
        let key = new_key();
        let answer = tokio::spawn({
            let (client, api_key, key) = (app.client.clone(), app.api_key.clone(), key.clone());
            async move {
                client
                    .post(format!("http://127.0.0.1:{port}/payments"))
                    .bearer_auth(api_key)
                    .header("Idempotency-Key", key)
                    .json(&json!({ "amount": 5, "account": "held" }))
                    .send()
                    .await
            }
        });
        Self {
            app,
            server,
            logs,
            ops,
            lock,
            key,
            answer,
        }
    }
}

/// Found from outside: on SIGTERM the API listener closed at once while the operations
/// listener's `/readyz`, where probes are told to point, said 200 until the process left; and a
/// payment waiting on its account's row when the 10 s drain ended was cut unanswered, then
/// committed after the process had gone. Now `/readyz` is 503 on both listeners from the
/// signal on, and the drain lasts as long as a payment can (acquire timeout + statement
/// timeout + 1 s): the payment, held 11 s, is answered with what it did.
#[tokio::test]
async fn on_sigterm_readyz_turns_503_and_a_payment_held_past_ten_seconds_gets_its_answer() {
    use crate::commands::{sigterm, stop_logged};
    let HeldPayment {
        app,
        mut server,
        logs,
        ops,
        lock,
        answer: payment,
        ..
    } = HeldPayment::send().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let signalled = std::time::Instant::now();
    sigterm(&server);

    let readyz = format!("http://127.0.0.1:{ops}/readyz");
    let mut answers = Vec::new();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        answers.push(app.client.get(&readyz).send().await.map(|r| r.status().as_u16()).ok());
    }
    assert!(
        answers.iter().skip(2).all(|a| *a == Some(503)),
        "the operations listener's /readyz from 300 ms after SIGTERM: {answers:?}"
    );

    tokio::time::sleep(Duration::from_secs(11).saturating_sub(signalled.elapsed())).await;
    let mut lock = lock;
    sqlx::query("COMMIT").execute(&mut lock).await.unwrap();
    let answered = payment.await.unwrap();
    let status = answered.as_ref().map(|r| r.status().as_u16());
    let stopped = tokio::time::timeout(Duration::from_secs(15), server.wait()).await;
    let logs = if stopped.is_ok() {
        logs.await.unwrap()
    } else {
        stop_logged(&mut server, logs).await
    };
    assert!(
        matches!(status, Ok(201)),
        "the payment held 11 s into the drain is answered: {status:?}\n{logs}"
    );
    assert!(
        stopped.is_ok(),
        "the process stops once its requests are answered:\n{logs}"
    );
    assert!(logs.contains("oncepay stopping"), "{logs}");
    assert_eq!(app.balance("held").await, 95, "charged once");
}

/// Found from outside: a process killed with SIGKILL while its payment waited on the
/// account's row lock left the statement waiting, and it committed seconds later, when the
/// lock was freed, with no process to answer or log it. Its sessions now ask PostgreSQL to
/// look at the client's socket while a statement runs (`client_connection_check_interval`):
/// the killed process's statement ends, and nothing is charged.
#[tokio::test]
async fn a_payment_waiting_on_a_lock_when_its_process_is_killed_does_not_commit_later() {
    let HeldPayment {
        app,
        mut server,
        mut lock,
        key,
        answer: payment,
        ..
    } = HeldPayment::send().await;
    let backend = crate::concurrency::blocked_payment_backend(&app, &mut lock).await;
    server.kill().await.unwrap();
    assert!(payment.await.unwrap().is_err(), "the killed process answered nothing");

    // Bounded: PostgreSQL looks at the socket once a second.
    let mut ended = false;
    for _ in 0..50 {
        let alive: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
            .bind(backend)
            .fetch_one(&app.pool)
            .await
            .unwrap();
        if !alive {
            ended = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sqlx::query("COMMIT").execute(&mut lock).await.unwrap();
    // Had the statement lived on, it would now take the freed row and commit.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(app.balance("held").await, 100, "nothing charged");
    assert_eq!(
        app.get(&format!("/idempotency-keys/{key}")).await.status,
        404,
        "nothing stored under the key"
    );
    assert!(ended, "the killed process's statement ended within 5 s");
}
