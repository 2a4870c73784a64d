//! The server-side commands of the real `oncepay` binary: serve's schema check, tenant
//! create, purge (docs/operations.md, commands).

use std::time::{Duration, Instant};

use tokio::process::Command;

use crate::support::helpers::{drop_database, empty_database, new_key};

pub struct Run {
    pub status: i32,
    pub stdout: String,
    pub stderr: String,
}

/// The real `oncepay` binary with `args`, on `database_url`, within 60 s.
pub async fn oncepay(args: &[&str], database_url: &str) -> Run {
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .args(args)
            .env("DATABASE_URL", database_url)
            .env("ONCEPAY_BIND", "127.0.0.1:0")
            .env("ONCEPAY_METRICS_BIND", "127.0.0.1:0")
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the command ends within 60 s")
    .expect("the binary runs");
    Run {
        status: output.status.code().expect("exited, not killed"),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Found from outside (a rollout probe): every build said `oncepay 0.1.0`, so replicas of two
/// builds serving together could not be told apart. The commit the build came from is in
/// `--version` and in `oncepay_build_info` (with the newest migration the build embeds).
#[tokio::test]
async fn a_build_names_its_commit_in_its_version_and_its_metrics() {
    assert!(!oncepay::BUILD_COMMIT.is_empty());
    let version = oncepay(&["--version"], "postgres://unused").await;
    assert_eq!(version.status, 0, "{}", version.stderr);
    assert_eq!(
        version.stdout.trim(),
        format!(
            "oncepay {} (commit {})",
            env!("CARGO_PKG_VERSION"),
            oncepay::BUILD_COMMIT
        )
    );
    let app = crate::support::helpers::spawn_app().await;
    let series = format!(
        "oncepay_build_info{{commit=\"{}\",schema=\"{}\",version=\"{}\"}}",
        oncepay::BUILD_COMMIT,
        oncepay::db::expected_schema_version(),
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(
        crate::support::helpers::metric_value(&app.metrics().await, &series),
        1.0,
        "{series}"
    );
}

#[tokio::test]
async fn serve_on_a_schema_that_is_behind_exits_with_one_line_naming_migrate() {
    let url = empty_database("servebehind").await;

    let run = oncepay(&["serve"], &url).await;

    assert_ne!(run.status, 0);
    // The error is one line (warnings of the start-up, such as an unset webhook secret key,
    // may precede it: `serve` binds before it reaches the database).
    let errors: Vec<&str> = run.stderr.lines().filter(|l| l.starts_with("oncepay: ")).collect();
    assert_eq!(errors.len(), 1, "one error line: {:?}", run.stderr);
    assert!(errors[0].contains("oncepay migrate"), "{}", run.stderr);
    assert!(run.stdout.is_empty());
    drop_database(&url).await;
}

#[tokio::test]
async fn migrate_then_tenant_create_prints_one_json_object_with_a_working_key() {
    let url = empty_database("tenantcli").await;
    assert_eq!(oncepay(&["migrate"], &url).await.status, 0);

    let run = oncepay(
        &[
            "tenant",
            "create",
            "--name",
            "shop",
            "--missing-key-policy",
            "fingerprint",
            "--main-balance",
            "500",
        ],
        &url,
    )
    .await;

    assert_eq!(run.status, 0, "{}", run.stderr);
    let created: serde_json::Value = serde_json::from_str(run.stdout.trim()).expect("one JSON object on stdout");
    assert_eq!(created["name"], "shop");
    assert_eq!(created["missing_key_policy"], "fingerprint");
    assert!(created["api_key"].as_str().unwrap().starts_with("opk_"));
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let balance: i64 =
        sqlx::query_scalar("SELECT balance FROM accounts WHERE tenant_id = $1::uuid AND account_id = 'main'")
            .bind(created["tenant_id"].as_str().unwrap())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(balance, 500);
    let refused = oncepay(&["tenant", "create", "--name", "x", "--main-balance", "-1"], &url).await;
    assert_ne!(refused.status, 0);
    // A name the admin API refuses, the command refuses alike, naming the rule (found from
    // outside: a blank name was taken).
    for name in ["", " ", "a\u{7}b", &"n".repeat(201)] {
        let refused = oncepay(&["tenant", "create", "--name", name], &url).await;
        assert_ne!(refused.status, 0, "{name:?}");
        assert!(
            refused.stderr.contains("--name: `name` must be a non-blank string"),
            "{name:?}: {}",
            refused.stderr
        );
    }
    let tenants: i64 = sqlx::query_scalar("SELECT count(*) FROM tenants")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(tenants, 1, "only the shop");
    pool.close().await;
    drop_database(&url).await;
}

#[tokio::test]
async fn purge_prints_deleted_n() {
    let url = empty_database("purgecli").await;
    assert_eq!(oncepay(&["migrate"], &url).await.status, 0);
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::query(
        "INSERT INTO idempotency_keys (tenant_id, key, fingerprint, operation, method, path, status, resource_id, created_at, expires_at)
         SELECT gen_random_uuid(), 'k' || i, sha256(i::text::bytea), 'pay'::oncepay_operation, 'POST', '/payments', 201, gen_random_uuid()::text, now() - interval '8 days', now() - interval '7 days'
           FROM generate_series(1, 42) i",
    )
    .execute(&pool)
    .await
    .unwrap();

    let run = oncepay(&["purge"], &url).await;

    assert_eq!(run.status, 0, "{}", run.stderr);
    assert_eq!(run.stdout.trim(), "deleted=42");
    pool.close().await;
    drop_database(&url).await;
}

/// Waits (at most 30 s) until the server process on `port` has reached its database: it
/// answers from the start, and 503 to everything but its probes until then.
pub async fn wait_until_ready(client: &reqwest::Client, port: u16) {
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    for _ in 0..300 {
        if let Ok(answer) = client.get(&readyz).send().await {
            if answer.status() == 200 {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the server on port {port} was not ready within 30 s");
}

/// `oncepay serve` with `env`, its stderr read as it is written (a pipe nobody reads fills,
/// 64 kB, and stops the server at its next log line); [`stop_logged`] gives the log.
pub fn serve_logged(env: &[(&str, String)]) -> (tokio::process::Child, tokio::task::JoinHandle<String>) {
    let mut server = Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .arg("serve")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stderr = server.stderr.take().unwrap();
    let logs = tokio::spawn(async move {
        let mut all = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut stderr, &mut all)
            .await
            .unwrap();
        String::from_utf8_lossy(&all).into_owned()
    });
    (server, logs)
}

/// Kills a server of [`serve_logged`] (at most 20 s to stop) and answers its whole log.
pub async fn stop_logged(server: &mut tokio::process::Child, logs: tokio::task::JoinHandle<String>) -> String {
    server.start_kill().unwrap();
    tokio::time::timeout(Duration::from_secs(20), server.wait())
        .await
        .expect("the server stops")
        .unwrap();
    logs.await.unwrap()
}

/// Sends SIGTERM to a server process (a graceful stop).
pub fn sigterm(server: &tokio::process::Child) {
    let pid = server.id().expect("the process runs").to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(sent.success(), "kill -TERM {pid}");
}

/// A free port on 127.0.0.1 for a server process (bound, read, released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Found from outside (a soak writing each server's log to a file): the text format carried
/// terminal colour codes into files and pipes, so the runbooks' `grep 'outcome="key_reused"'`
/// found nothing. To a pipe, the text log is plain: the fields read as operations.md writes
/// them.
#[tokio::test]
async fn the_text_log_written_to_a_pipe_has_no_colour_codes() {
    let app = crate::support::helpers::spawn_app().await;
    let port = free_port();
    let (mut server, logs) = serve_logged(&[
        ("DATABASE_URL", crate::support::helpers::database_url()),
        ("ONCEPAY_BIND", format!("127.0.0.1:{port}")),
        ("ONCEPAY_METRICS_BIND", "127.0.0.1:0".to_owned()),
        ("RUST_LOG", "info".to_owned()),
        ("ONCEPAY_WEBHOOK_CONCURRENCY", "0".to_owned()),
    ]);
    wait_until_ready(&app.client, port).await;
    let answer = app
        .client
        .post(format!("http://127.0.0.1:{port}/payments"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", new_key())
        .json(&serde_json::json!({ "amount": 7 }))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status().as_u16(), 201);
    let log = stop_logged(&mut server, logs).await;
    assert!(!log.contains('\u{1b}'), "no escape codes: {log}");
    assert!(log.contains("outcome=\"created\""), "{log}");
}

#[tokio::test]
async fn serve_logs_one_json_line_per_request_without_keys_or_bodies() {
    let app = crate::support::helpers::spawn_app().await;
    let port = free_port();
    let (mut server, logs) = serve_logged(&[
        ("DATABASE_URL", crate::support::helpers::database_url()),
        ("ONCEPAY_BIND", format!("127.0.0.1:{port}")),
        ("ONCEPAY_METRICS_BIND", "127.0.0.1:0".to_owned()),
        ("ONCEPAY_LOG_FORMAT", "json".to_owned()),
        ("RUST_LOG", "info".to_owned()),
        // It delivers nothing: on the shared database other tests' deliveries are due, whose
        // sealed secrets this process (no ONCEPAY_WEBHOOK_SECRET_KEY) cannot open.
        ("ONCEPAY_WEBHOOK_CONCURRENCY", "0".to_owned()),
        // A misspelled setting (ONCEPAY_REPLAY_WINDOW_SECS), otherwise left at its default in
        // silence.
        ("ONCEPAY_REPLAY_WINDOW", "60".to_owned()),
    ]);
    let url = format!("http://127.0.0.1:{port}/payments");
    wait_until_ready(&app.client, port).await;
    let mut answered = None;
    let mut round_trip = Duration::ZERO;
    for _ in 0..100 {
        let sent_at = Instant::now();
        let sent = app
            .client
            .post(&url)
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", "log-me-once")
            .header("x-request-id", "req-json-1")
            .json(&serde_json::json!({ "amount": 7, "account": "main" }))
            .send()
            .await;
        if let Ok(response) = sent {
            round_trip = sent_at.elapsed();
            answered = Some(response.status().as_u16());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(answered, Some(201), "the server answered within 10 s");
    let replay = app
        .client
        .post(&url)
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", "log-me-once")
        .json(&serde_json::json!({ "amount": 7, "account": "main" }))
        .send()
        .await
        .unwrap();
    assert_eq!(replay.status().as_u16(), 201);
    let logs = stop_logged(&mut server, logs).await;
    let misspelled = logs
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find(|entry| entry["variable"] == "ONCEPAY_REPLAY_WINDOW")
        .unwrap_or_else(|| panic!("the misspelled variable is named: {logs}"));
    assert_eq!(misspelled["level"], "WARN", "{misspelled}");

    let requests: Vec<serde_json::Value> = logs
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap_or_else(|_| panic!("not JSON: {line}")))
        .filter(|entry| entry["message"] == "request" && entry["route"] != "/readyz")
        .collect();
    assert_eq!(requests.len(), 2, "{logs}");
    let first = &requests[0];
    assert_eq!(first["request_id"], "req-json-1");
    assert_eq!(first["tenant"], app.tenant_id.to_string());
    assert_eq!(first["route"], "/payments");
    assert_eq!(first["status"], 201);
    assert_eq!(first["outcome"], "created");
    assert_eq!(first["replayed"], false);
    let latency_ms = first["latency_ms"].as_f64().expect("latency_ms is a number");
    assert!(
        (0.0..=round_trip.as_secs_f64() * 1e3).contains(&latency_ms),
        "latency {latency_ms} ms, client's round trip {round_trip:?}"
    );
    assert_eq!(requests[1]["outcome"], "replayed");
    assert_eq!(requests[1]["replayed"], true);
    assert!(!logs.contains(&app.api_key), "an API key was logged");
    assert!(!logs.contains("\"amount\""), "a body was logged");
}

/// Found from outside: behind a transaction-mode pooler a statement carries its argument in
/// its text (hexadecimal JSON of the batch), and sqlx's own statement lines, a slow one at
/// `warn`, wrote it to the log: tenant, key, account and amount of every payment of the batch.
/// None of sqlx's statement lines are written in that mode, at any level.
#[tokio::test]
async fn behind_a_pooler_a_slow_statement_logs_no_payment_of_its_batch() {
    let app = crate::support::helpers::spawn_app().await;
    let account = "acct-never-logged";
    app.open_account(account, 100).await;
    let port = free_port();
    let (mut server, logs) = serve_logged(&[
        ("DATABASE_URL", crate::support::helpers::database_url()),
        ("ONCEPAY_DB_POOLER", "transaction".to_owned()),
        ("ONCEPAY_BIND", format!("127.0.0.1:{port}")),
        ("ONCEPAY_METRICS_BIND", "127.0.0.1:0".to_owned()),
        ("ONCEPAY_LOG_FORMAT", "json".to_owned()),
        ("RUST_LOG", "info,sqlx=trace".to_owned()),
        ("ONCEPAY_WEBHOOK_CONCURRENCY", "0".to_owned()),
    ]);
    wait_until_ready(&app.client, port).await;
    // The payment waits on its account's row for longer than sqlx's slow-statement second.
    let lock =
        crate::concurrency::lock_account_at(&crate::support::helpers::database_url(), app.tenant_id, account).await;
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let mut lock = lock;
        sqlx::query("COMMIT").execute(&mut lock).await.unwrap();
    });
    let sent_at = Instant::now();
    let paid = app
        .client
        .post(format!("http://127.0.0.1:{port}/payments"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", "key-never-logged")
        .json(&serde_json::json!({ "amount": 77, "account": account }))
        .send()
        .await
        .unwrap();
    assert_eq!(paid.status().as_u16(), 201);
    assert!(
        sent_at.elapsed() > Duration::from_secs(1),
        "its statement was a slow one"
    );
    release.await.unwrap();
    let logs = stop_logged(&mut server, logs).await;
    for secret in [account, "key-never-logged"] {
        assert!(!logs.contains(secret), "{secret} was logged: {logs}");
        assert!(
            !logs.contains(&hex::encode(secret)),
            "{secret} was logged in hexadecimal: {logs}"
        );
    }
}
