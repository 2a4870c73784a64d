//! `TestApp`: a real oncepay server on a free port, against the real PostgreSQL named by
//! `DATABASE_URL` (the Makefile points it at a fresh test database), with a fresh tenant
//! per test. Logs are shown with `TEST_LOG=1`.

use std::sync::{Arc, Once};
use std::time::Duration;

use oncepay::config::Settings;
use oncepay::domain::{MissingKeyPolicy, OpeningBalance};
use oncepay::startup::Application;
use oncepay::state::AppState;
use reqwest::{Method, Response};
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, Executor, PgPool};
use tokio::task::JoinHandle;
use uuid::Uuid;

pub const ADMIN_TOKEN: &str = "test-admin-token-of-at-least-32-characters";
pub const MAIN_BALANCE: i64 = 10_000;
/// How long a server started on a reachable database may take to be ready.
pub const READY_WITHIN: Duration = Duration::from_secs(30);

static TRACING: Once = Once::new();

pub fn database_url() -> String {
    std::env::var("DATABASE_URL").expect("DATABASE_URL must name the test database (make test sets it)")
}

/// With `ONCEPAY_TEST_POOLER_URL` (`make test-pgbouncer`: the test database through
/// PgBouncer), the servers connect through the pooler and the tests' own queries do not:
/// `(through the pooler, direct)` URL prefixes, up to the database name.
fn pooler_prefixes() -> Option<(String, String)> {
    let pooler = std::env::var("ONCEPAY_TEST_POOLER_URL").ok()?;
    let prefix = |url: &str| url[..url.rfind('/').expect("a URL with a database")].to_owned();
    Some((prefix(&pooler), prefix(&database_url())))
}

/// Whether the servers reach PostgreSQL through a pooler (`make test-pgbouncer`).
pub fn through_pooler() -> bool {
    pooler_prefixes().is_some()
}

/// The URL of a server's database, bypassing any pooler.
pub fn direct_url(state: &AppState) -> String {
    match pooler_prefixes() {
        None => state.settings.database_url.clone(),
        Some((pooler, direct)) => state.settings.database_url.replacen(&pooler, &direct, 1),
    }
}

/// A pool for the test's own queries on a server's database, bypassing any pooler.
pub fn admin_pool(state: &AppState) -> PgPool {
    PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy(&direct_url(state))
        .expect("a valid URL")
}

/// The URL a server uses for the database at `direct`: through the pooler, if there is one.
pub fn server_url(direct: &str) -> String {
    match pooler_prefixes() {
        Some((pooler, prefix)) => direct.replacen(&prefix, &pooler, 1),
        None => direct.to_owned(),
    }
}

/// Settings for a test instance: a free port, a small pool, the admin API on. Servers start
/// from them through [`TestApp::builder`]; tests that need no server may use them directly.
pub fn test_settings() -> Settings {
    let mut settings = Settings::from_env_with_database(server_url(&database_url())).expect("valid settings");
    settings.bind = "127.0.0.1:0".to_owned();
    settings.metrics_bind = "127.0.0.1:0".to_owned();
    settings.admin_token = Some(ADMIN_TOKEN.to_owned());
    settings.db_pool_size = 10;
    settings.workers = 2;
    // Webhook endpoints can be created; only the webhook tests run delivery workers
    // (tests/api/webhooks/), with short waits.
    settings.webhooks.secret_key = Some([42; 32]);
    settings.webhooks.allow_private = true;
    settings.webhooks.concurrency = 0;
    settings.webhooks.poll = Duration::from_millis(50);
    settings.webhooks.timeout = Duration::from_secs(2);
    settings.webhooks.retry_schedule = [0.2, 0.3, 0.5, 1.0, 1.0, 2.0, 2.0]
        .map(Duration::from_secs_f64)
        .to_vec();
    // Every test's recovery of more than two deliveries runs in slices (migrations/V51).
    settings.webhooks.recovery_slice = 2;
    settings
}

/// A handle on a running server (cloning it shares the server).
#[derive(Clone)]
pub struct TestApp {
    pub address: String,
    /// The operations listener (`/metrics`, `/healthz`, `/readyz`).
    pub operations_address: String,
    pub client: reqwest::Client,
    pub pool: PgPool,
    pub state: Arc<AppState>,
    pub tenant_id: Uuid,
    pub api_key: String,
}

pub async fn migrate_once() {
    static MIGRATED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    MIGRATED
        .get_or_init(|| async {
            oncepay::db::migrate(&database_url()).await.expect("migrations apply");
        })
        .await;
}

/// The one way tests start a server: `TestApp::builder().settings(|s| ..).spawn()`.
#[must_use]
pub struct TestAppBuilder {
    settings: Settings,
    tenant: Option<(Uuid, String)>,
}

impl TestApp {
    pub fn builder() -> TestAppBuilder {
        TestAppBuilder {
            settings: test_settings(),
            tenant: None,
        }
    }
}

impl TestAppBuilder {
    /// Adjusts the test settings (a free port, a small pool, the admin API on).
    pub fn settings(mut self, adjust: impl FnOnce(&mut Settings)) -> Self {
        adjust(&mut self.settings);
        self
    }

    /// Serves `other`'s tenant instead of creating one: another replica of the same service.
    pub fn tenant_of(mut self, other: &TestApp) -> Self {
        self.tenant = Some((other.tenant_id, other.api_key.clone()));
        self
    }

    /// Serves the tenant `tenant` (made by the test) instead of creating one.
    pub fn with_tenant(mut self, tenant: Uuid, api_key: String) -> Self {
        self.tenant = Some((tenant, api_key));
        self
    }

    /// Builds and starts the server, as `oncepay serve` does, and returns once it is ready;
    /// `Err` where `serve` would refuse to start or stop (a schema behind the binary).
    pub async fn try_spawn(self) -> anyhow::Result<TestApp> {
        let tenant = self.tenant.clone();
        let (app, mut serving) = self.start().await?;
        app.wait_for_readiness(&mut serving).await?;
        Ok(app.serving(tenant).await)
    }

    /// Builds and starts the server and returns at once, ready or not: for the tests of
    /// start-up while the database is away. The tenant must be given (`with_tenant`): there
    /// may be no database yet to make one on.
    pub async fn spawn_unready(self) -> TestApp {
        let tenant = self
            .tenant
            .clone()
            .expect("spawn_unready serves a tenant the test made");
        let (app, _serving) = self.start().await.expect("the app binds");
        app.serving(Some(tenant)).await
    }

    /// Builds the server and runs it in a task of its own, which returns what
    /// `run_until_stopped` does.
    async fn start(self) -> anyhow::Result<(TestApp, JoinHandle<anyhow::Result<()>>)> {
        TRACING.call_once(|| {
            if std::env::var("TEST_LOG").is_ok() {
                oncepay::telemetry::init(false);
            }
        });
        migrate_once().await;
        let app = Application::build(self.settings)?;
        let address = format!("http://127.0.0.1:{}", app.port());
        let operations_address = format!("http://127.0.0.1:{}", app.operations_port());
        let state = app.state();
        let serving = tokio::spawn(app.run_until_stopped());
        let pool = admin_pool(&state);
        let app = TestApp {
            address,
            operations_address,
            client: client(),
            pool,
            state,
            tenant_id: Uuid::nil(),
            api_key: String::new(),
        };
        Ok((app, serving))
    }

    pub async fn spawn(self) -> TestApp {
        self.try_spawn().await.expect("the app starts")
    }

    /// `n` servers with these settings (each its own pool and workers) on one database, all
    /// for one tenant: replicas of one service.
    pub async fn spawn_instances(self, n: usize) -> Vec<TestApp> {
        let settings = self.settings.clone();
        let first = self.spawn().await;
        let mut apps = Vec::with_capacity(n);
        for _ in 1..n {
            let replica = TestAppBuilder {
                settings: settings.clone(),
                tenant: None,
            };
            apps.push(replica.tenant_of(&first).spawn().await);
        }
        apps.insert(0, first);
        apps
    }
}

impl TestApp {
    /// This server, serving `tenant` or a fresh one (policy `reject`, main balance 10000).
    async fn serving(mut self, tenant: Option<(Uuid, String)>) -> Self {
        (self.tenant_id, self.api_key) = match tenant {
            Some(tenant) => tenant,
            None => new_tenant(&self.pool, MissingKeyPolicy::Reject).await,
        };
        self
    }

    /// Waits until the server has reached its database and checked the schema, within
    /// [`READY_WITHIN`]; `Err` with what stopped it if it stopped first (`serving` is its task).
    async fn wait_for_readiness(&self, serving: &mut JoinHandle<anyhow::Result<()>>) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + READY_WITHIN;
        while !self.state.is_ready() {
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the server was not ready within {READY_WITHIN:?}"
            );
            tokio::select! {
                stopped = &mut *serving => {
                    stopped??;
                    anyhow::bail!("the server stopped before it was ready");
                }
                () = tokio::time::sleep(Duration::from_millis(5)) => {}
            }
        }
        Ok(())
    }
}

/// A server with the test settings and a fresh tenant (policy `reject`, main balance 10000).
pub async fn spawn_app() -> TestApp {
    TestApp::builder().spawn().await
}

/// Like [`spawn_app`], with adjusted settings.
pub async fn spawn_app_with(adjust: impl FnOnce(&mut Settings)) -> TestApp {
    TestApp::builder().settings(adjust).spawn().await
}

/// `n` servers (each its own pool and workers) on one database, all for one tenant.
pub async fn spawn_instances(n: usize) -> Vec<TestApp> {
    TestApp::builder().spawn_instances(n).await
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(64)
        .build()
        .expect("client builds")
}

pub async fn new_tenant(pool: &PgPool, policy: MissingKeyPolicy) -> (Uuid, String) {
    let balance = OpeningBalance::new(MAIN_BALANCE).unwrap();
    let created = oncepay::tenants::create(&oncepay::db::Db::beside(pool), "test", policy, balance)
        .await
        .expect("tenant created");
    (created.tenant_id.get(), created.api_key)
}

/// A JSON answer: status, headers and parsed body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

/// Every time in an answer reads `YYYY-MM-DDTHH:MM:SS.ffffffZ` (docs/api.md, times): one
/// length, so that their texts sort as the times do. Checked on every answer a test reads.
fn assert_times_in_microseconds(value: &Value) {
    match value {
        Value::String(text) if chrono::DateTime::parse_from_rfc3339(text).is_ok() => {
            let b = text.as_bytes();
            let digits = |range: std::ops::Range<usize>| b[range].iter().all(u8::is_ascii_digit);
            assert!(
                b.len() == 27 && b[19] == b'.' && b[26] == b'Z' && digits(0..4) && digits(20..26),
                "a time not in microseconds with Z: {text}"
            );
        }
        Value::Array(items) => items.iter().for_each(assert_times_in_microseconds),
        Value::Object(fields) => fields.values().for_each(assert_times_in_microseconds),
        _ => {}
    }
}

impl Answer {
    pub async fn from(response: Response) -> Self {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let bytes = response.bytes().await.expect("body read");
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| panic!("body is not JSON: {}", String::from_utf8_lossy(&bytes)))
        };
        assert_times_in_microseconds(&body);
        Self { status, headers, body }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotency-replayed") == Some("true")
    }

    pub fn code(&self) -> &str {
        self.body["code"].as_str().unwrap_or("")
    }

    /// Asserts a problem+json error with this status and code.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "unexpected status, body: {}", self.body);
        assert_eq!(self.code(), code, "unexpected code, body: {}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "errors are problem+json"
        );
        for field in ["type", "title", "status", "detail"] {
            assert!(!self.body[field].is_null(), "problem without `{field}`: {}", self.body);
        }
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.address, path)
    }

    /// A tenant POST with an optional key and a JSON body.
    pub async fn post(&self, path: &str, key: Option<&str>, body: &Value) -> Answer {
        self.post_as(&self.api_key, path, key, body).await
    }

    pub async fn post_as(&self, api_key: &str, path: &str, key: Option<&str>, body: &Value) -> Answer {
        let mut request = self.client.post(self.url(path)).bearer_auth(api_key).json(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        Answer::from(request.send().await.expect("request sent")).await
    }

    pub async fn pay(&self, key: Option<&str>, amount: i64) -> Answer {
        self.post("/payments", key, &serde_json::json!({ "amount": amount }))
            .await
    }

    pub async fn refund(&self, key: Option<&str>, payment_id: &str) -> Answer {
        self.post(&format!("/payments/{payment_id}/refund"), key, &serde_json::json!({}))
            .await
    }

    pub async fn deposit(&self, key: Option<&str>, account: &str, amount: i64) -> Answer {
        self.post(
            &format!("/accounts/{account}/deposits"),
            key,
            &serde_json::json!({ "amount": amount }),
        )
        .await
    }

    pub async fn transfer(&self, key: Option<&str>, from: &str, to: &str, amount: i64) -> Answer {
        self.post(
            "/transfers",
            key,
            &serde_json::json!({ "from": from, "to": to, "amount": amount }),
        )
        .await
    }

    /// The Prometheus exposition of this instance.
    pub async fn metrics(&self) -> String {
        let response = self
            .client
            .get(format!("{}/metrics", self.operations_address))
            .send()
            .await
            .expect("request sent");
        response.text().await.expect("metrics read")
    }

    pub async fn get(&self, path: &str) -> Answer {
        self.get_as(&self.api_key, path).await
    }

    pub async fn get_as(&self, api_key: &str, path: &str) -> Answer {
        let response = self
            .client
            .get(self.url(path))
            .bearer_auth(api_key)
            .send()
            .await
            .expect("request sent");
        Answer::from(response).await
    }

    pub async fn admin(&self, method: Method, path: &str, body: Option<&Value>) -> Answer {
        let mut request = self.client.request(method, self.url(path)).bearer_auth(ADMIN_TOKEN);
        if let Some(body) = body {
            request = request.json(body);
        }
        Answer::from(request.send().await.expect("request sent")).await
    }

    pub async fn set_policy(&self, policy: &str) {
        let answer = self
            .admin(
                Method::PATCH,
                &format!("/admin/tenants/{}", self.tenant_id),
                Some(&serde_json::json!({ "missing_key_policy": policy })),
            )
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }

    /// The balance, read from the database (not through the API under test).
    pub async fn balance(&self, account: &str) -> i64 {
        sqlx::query_scalar("SELECT balance FROM accounts WHERE tenant_id = $1 AND account_id = $2")
            .bind(self.tenant_id)
            .bind(account)
            .fetch_one(&self.pool)
            .await
            .expect("account exists")
    }

    pub async fn payment_count(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM payments WHERE tenant_id = $1")
            .bind(self.tenant_id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn key_count(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE tenant_id = $1")
            .bind(self.tenant_id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn open_account(&self, id: &str, balance: i64) {
        let answer = self
            .post(
                "/accounts",
                Some(&Uuid::new_v4().to_string()),
                &serde_json::json!({ "id": id, "balance": balance }),
            )
            .await;
        assert_eq!(answer.status, 201, "{}", answer.body);
    }
}

/// The value of one series (`name{labels}` as exposed) in a Prometheus text; 0 while absent.
pub fn metric_value(exposition: &str, series: &str) -> f64 {
    exposition
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// `id` is an RFC 9562 version 7 id whose time (`Uuid::get_timestamp`) lies between
/// `before` and `after`, Unix milliseconds.
pub fn assert_v7_between(id: Uuid, before: i64, after: i64) {
    assert_eq!(id.get_version_num(), 7, "{id}");
    assert_eq!(id.get_variant(), uuid::Variant::RFC4122, "{id}");
    let (secs, nanos) = id.get_timestamp().expect("a v7 has a time").to_unix();
    let millis = i64::try_from(secs).unwrap() * 1_000 + i64::from(nanos / 1_000_000);
    assert!(
        (before..=after).contains(&millis),
        "{id}: {millis} not in {before}..={after}"
    );
}

pub fn new_key() -> String {
    Uuid::new_v4().to_string()
}

/// A new, empty database on the test cluster; returns its URL.
pub async fn empty_database(name_hint: &str) -> String {
    let name = format!("oncepay_{name_hint}_{}", Uuid::new_v4().simple());
    // PostgreSQL cuts a longer name to 63 bytes, and connects to the cut name too; PgBouncer
    // looks the whole name up and finds no such database (the test then fails only there).
    assert!(
        name.len() <= 63,
        "{name} is longer than PostgreSQL's 63 bytes: give a name hint of at most 22 characters"
    );
    let mut conn = sqlx::PgConnection::connect(&database_url()).await.unwrap();
    conn.execute(format!("CREATE DATABASE {name}").as_str()).await.unwrap();
    let (base, _) = database_url()
        .rsplit_once('/')
        .map(|(b, d)| (b.to_owned(), d.to_owned()))
        .unwrap();
    format!("{base}/{name}")
}

/// A server on a migrated database of the test's own (for tests that cut its sessions or
/// turn it read-only); returns the server and the database's direct URL.
pub async fn spawn_app_on_own_database(name_hint: &str) -> (TestApp, String) {
    spawn_app_on_own_database_with(name_hint, |_| {}).await
}

/// [`spawn_app_on_own_database`] with adjusted settings.
pub async fn spawn_app_on_own_database_with(name_hint: &str, adjust: impl FnOnce(&mut Settings)) -> (TestApp, String) {
    let url = empty_database(name_hint).await;
    oncepay::db::migrate(&url).await.unwrap();
    let app = TestApp::builder()
        .settings(|s| {
            s.database_url = server_url(&url);
            adjust(s);
        })
        .spawn()
        .await;
    (app, url)
}

pub async fn drop_database(url: &str) {
    let name = url.rsplit('/').next().unwrap().to_owned();
    let mut conn = sqlx::PgConnection::connect(&database_url()).await.unwrap();
    conn.execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
        .await
        .unwrap();
}

/// How many of oncepay's backends wait, directly or in the queue behind another waiter, for a
/// lock that the backend `holder` holds. (A row's second waiter waits for the first one's
/// tuple lock, so `pg_blocking_pids` names the holder only for the first.)
pub async fn waiting_behind(pool: &PgPool, holder: i32) -> i64 {
    sqlx::query_scalar(
        "WITH RECURSIVE waiting AS (
             SELECT pid FROM pg_stat_activity
              WHERE application_name = 'oncepay' AND $1 = ANY(pg_blocking_pids(pid))
             UNION
             SELECT a.pid FROM pg_stat_activity a JOIN waiting w ON w.pid = ANY(pg_blocking_pids(a.pid))
              WHERE a.application_name = 'oncepay')
         SELECT count(*) FROM waiting",
    )
    .bind(holder)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Every endpoint the server documents (its OpenAPI document, generated from the operation
/// table and the routes): (method, path template). Tests that claim "every endpoint" start
/// from this list, so that a new endpoint fails them until they cover it.
pub fn documented_endpoints() -> Vec<(Method, String)> {
    let document: Value = serde_json::from_str(&oncepay::routes::openapi_document()).expect("the document is JSON");
    let mut endpoints = Vec::new();
    for (path, operations) in document["paths"].as_object().expect("paths") {
        for method in operations.as_object().expect("operations").keys() {
            let method = Method::from_bytes(method.to_uppercase().as_bytes()).expect("an HTTP method");
            endpoints.push((method, path.clone()));
        }
    }
    endpoints
}

/// The documented endpoints a tenant calls with its API key (not the admin's, not the
/// unauthenticated operations endpoints).
pub fn tenant_endpoints() -> Vec<(Method, String)> {
    documented_endpoints()
        .into_iter()
        .filter(|(_, path)| {
            !path.starts_with("/admin")
                && !matches!(path.as_str(), "/healthz" | "/readyz" | "/metrics" | "/openapi.json")
        })
        .collect()
}

/// Every documented tenant POST, its path parameter an existing account (`main`) or an
/// unknown id.
pub fn tenant_post_paths() -> Vec<String> {
    tenant_endpoints()
        .into_iter()
        .filter(|(method, _)| method == Method::POST)
        .map(|(_, template)| {
            let param = if template.starts_with("/accounts/") {
                "main".to_owned()
            } else {
                Uuid::new_v4().to_string()
            };
            fill(&template, &param)
        })
        .collect()
}

/// `template` with its path parameters (`{id}`, `{tenant_id}`, and a second one such as
/// `{event_id}`) each replaced by `id`.
pub fn fill(template: &str, id: &str) -> String {
    template
        .split('/')
        .map(|segment| {
            if segment.starts_with('{') && segment.ends_with('}') {
                id
            } else {
                segment
            }
        })
        .collect::<Vec<_>>()
        .join("/")
}
