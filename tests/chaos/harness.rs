//! Real parts for fault tests: the chaos PostgreSQL cluster (stopped and started with
//! scripts/db.sh), `oncepay serve` processes killed by pid, and the `oncepay audit` binary.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use oncepay::domain::{MissingKeyPolicy, OpeningBalance};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use uuid::Uuid;

/// The chaos database. These tests stop PostgreSQL, so they refuse to run anywhere but on
/// the cluster `make chaos` starts for them (ONCEPAY_PG_PORT / ONCEPAY_PGDATA).
pub fn database_url() -> String {
    let url = std::env::var("ONCEPAY_CHAOS_DATABASE_URL")
        .expect("ONCEPAY_CHAOS_DATABASE_URL is not set: run the chaos tests with `make chaos`");
    let port = std::env::var("ONCEPAY_PG_PORT").expect("ONCEPAY_PG_PORT names the chaos cluster's port");
    std::env::var("ONCEPAY_PGDATA").expect("ONCEPAY_PGDATA names the chaos cluster's data folder");
    assert!(
        url.contains(&format!(":{port}/")),
        "the chaos database {url} is not on the chaos cluster's port {port}"
    );
    url
}

/// Migrates the chaos database and opens a small pool the tests read through.
pub async fn pool() -> PgPool {
    oncepay::db::migrate(&database_url()).await.expect("migrations apply");
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&database_url())
        .await
        .expect("the chaos database answers")
}

pub struct Tenant {
    pub id: Uuid,
    pub api_key: String,
    pub opening: i64,
}

/// A tenant whose `main` account can pay for everything a test sends.
pub async fn tenant(pool: &PgPool) -> Tenant {
    let opening = oncepay::domain::MAX_AMOUNT;
    let balance = OpeningBalance::new(opening).unwrap();
    let created = oncepay::tenants::create(
        &oncepay::db::Db::beside(pool),
        "chaos",
        MissingKeyPolicy::Reject,
        balance,
    )
    .await
    .expect("tenant created");
    Tenant {
        id: created.tenant_id.get(),
        api_key: created.api_key,
        opening,
    }
}

/// Runs scripts/db.sh on the chaos cluster (the environment of `make chaos` names it).
async fn db_sh(args: &[&str], env: &[(&str, &str)]) {
    database_url();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/db.sh");
    let status = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::process::Command::new(script)
            .args(args)
            .envs(env.iter().copied())
            .status(),
    )
    .await
    .expect("db.sh finishes within 90 s")
    .expect("db.sh runs");
    assert!(status.success(), "scripts/db.sh {args:?} failed");
}

/// Stops PostgreSQL the hard way (immediate mode: no checkpoint, crash recovery at start).
pub async fn stop_postgres() {
    db_sh(&["down"], &[("ONCEPAY_PG_STOP_MODE", "immediate")]).await;
}

pub async fn start_postgres() {
    db_sh(&["up"], &[]).await;
}

/// Settings every chaos server shares: short waits, so that faults surface within seconds.
pub const SERVER_ENV: &[(&str, &str)] = &[
    ("ONCEPAY_WORKERS", "2"),
    ("ONCEPAY_DB_POOL_SIZE", "8"),
    ("ONCEPAY_DB_ACQUIRE_TIMEOUT_MS", "1000"),
    ("ONCEPAY_INFLIGHT_WAIT_MS", "1000"),
    ("ONCEPAY_STATEMENT_TIMEOUT_MS", "5000"),
    ("RUST_LOG", "warn"),
];

/// An `oncepay serve` process on a free port of 127.0.0.1; killed when dropped.
pub struct Server {
    child: tokio::process::Child,
    pub address: String,
    pub log: PathBuf,
}

impl Server {
    pub async fn start(env: &[(&str, &str)]) -> Self {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("chaos-server-{port}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .arg("serve")
            .env("DATABASE_URL", database_url())
            .env("ONCEPAY_BIND", format!("127.0.0.1:{port}"))
            .env("ONCEPAY_METRICS_BIND", "127.0.0.1:0")
            .envs(SERVER_ENV.iter().copied())
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .expect("oncepay serve starts");
        let server = Self {
            child,
            address: format!("http://127.0.0.1:{port}"),
            log,
        };
        server.wait_until_ready().await;
        server
    }

    async fn wait_until_ready(&self) {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(answer) = client.get(format!("{}/readyz", self.address)).send().await {
                if answer.status() == 200 {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the server did not get ready within 30 s; log: {}", self.log.display());
    }

    /// SIGKILL: no graceful shutdown, no answers to what is in flight.
    pub async fn kill9(&mut self) {
        self.child.start_kill().expect("kill -9");
        self.child.wait().await.expect("reaped");
    }

    /// Fails the test if the process has exited (a crash under a fault).
    pub fn assert_alive(&mut self) {
        let exited = self.child.try_wait().expect("waitable");
        assert!(
            exited.is_none(),
            "the server exited ({exited:?}); log: {}",
            self.log.display()
        );
    }

    pub async fn readyz(&self) -> u16 {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        match client.get(format!("{}/readyz", self.address)).send().await {
            Ok(answer) => answer.status().as_u16(),
            Err(err) => panic!("/readyz did not answer: {err}"),
        }
    }
}

/// The real `oncepay audit --json` over the whole chaos database; asserts a clean report.
pub async fn assert_audit_clean() -> serde_json::Value {
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .args(["audit", "--json"])
            .env("DATABASE_URL", database_url())
            .output(),
    )
    .await
    .expect("the audit finishes within 60 s")
    .expect("oncepay audit runs");
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|_| {
        panic!(
            "no JSON report: {} {}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    });
    assert_eq!(output.status.code(), Some(0), "the audit is not clean: {report:#}");
    assert_eq!(report["clean"], true);
    report
}
