//! Settings from the environment, validated once at startup (README.md, Settings).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};

/// Everything `oncepay serve` (and the other commands) read from the environment. Its
/// `Debug` hides the database password and the admin token.
#[derive(Clone)]
pub struct Settings {
    pub database_url: String,
    pub bind: String,
    /// Listen address of the operations endpoints (`ONCEPAY_METRICS_BIND`): `/metrics`,
    /// `/healthz`, `/readyz`. Loopback by default: the metrics name every tenant.
    pub metrics_bind: String,
    /// Bearer token for `/admin/*`; `None` disables the admin API (403).
    pub admin_token: Option<String>,
    pub replay_window: Duration,
    pub retention: Duration,
    /// How long events are kept, delivered or not, with their deliveries and attempts
    /// (`ONCEPAY_EVENT_RETENTION_DAYS`, default 30).
    pub event_retention: Duration,
    pub inflight_wait: Duration,
    pub fingerprint_window: Duration,
    pub max_body_bytes: usize,
    pub db_pool_size: u32,
    /// What stands between oncepay and PostgreSQL (`ONCEPAY_DB_POOLER`).
    pub db_pooler: Pooler,
    /// How long a request waits for a free pooled connection before 429 / 503.
    pub db_acquire_timeout: Duration,
    /// Upper bound on any one statement; also bounds waits on a hot account row.
    pub statement_timeout: Duration,
    /// Most payments one statement carries (`ONCEPAY_DB_BATCH_MAX`); 1 sends each payment
    /// as a statement of its own.
    pub db_batch_max: usize,
    /// Batched statements in flight per process, fixed (`ONCEPAY_DB_BATCHES_IN_FLIGHT`); unset,
    /// the batcher chooses it from the statements' latency (src/batch/limit.rs), between two and
    /// the pool's size. While all are out, payments queue and leave together in the next one.
    pub db_batches_in_flight: Option<usize>,
    /// Where the batcher's chosen limit starts: one statement per core, 2 to 8 (not a
    /// variable: the machine's; tests set it).
    pub db_batches_initial: usize,
    /// Most payments of one tenant in a process's statements at once while other tenants
    /// are paying too (`ONCEPAY_DB_TENANT_SHARE`); 0 turns the share off (src/batch/mod.rs).
    pub db_tenant_share: usize,
    /// Opt-in in-process purge schedule (`ONCEPAY_PURGE_INTERVAL_SECS`); `None` = off.
    pub purge_interval: Option<Duration>,
    pub purge_batch_size: i64,
    /// HTTP worker threads; defaults to the number of cores.
    pub workers: usize,
    /// Open connections of the API listener per process (`ONCEPAY_MAX_CONNECTIONS`, default
    /// [`CONNECTIONS_PER_WORKER`] per worker); past 80 % of it idle keep-alive connections are
    /// closed first (src/http1/connections.rs), at it new ones wait in the listen backlog.
    pub max_connections: usize,
    /// Open connections from one peer IP address per process (`ONCEPAY_MAX_CONNECTIONS_PER_PEER`);
    /// more are refused at accept. 0, the default, turns the cap off: behind a balancer every
    /// client shares the balancer's address.
    pub max_connections_per_peer: usize,
    pub log_json: bool,
    /// Finished results kept in memory to answer replays (`ONCEPAY_REPLAY_CACHE_ENTRIES`);
    /// 0 turns the cache off.
    pub replay_cache_entries: u64,
    /// PEM certificate chain and private key (`ONCEPAY_TLS_CERT`, `ONCEPAY_TLS_KEY`): with
    /// both, `serve` speaks HTTPS; with one alone it refuses to start.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// The card processor of top-ups (docs/top-ups.md): `None` answers 501.
    pub processor: Option<Processor>,
    /// The currency of every amount (`ONCEPAY_CURRENCY`), sent to the processor.
    pub currency: String,
    /// An unfinished top-up untouched this long is finished by the completer of any replica
    /// (`ONCEPAY_COMPLETER_AFTER_SECS`).
    pub completer_after: Duration,
    /// A top-up whose PaymentIntent waits this long (from the top-up's creation) for an action
    /// the API cannot take (`requires_action`, `requires_capture`) is canceled at the processor
    /// and stored as a failure (`ONCEPAY_TOPUP_ACTION_TIMEOUT_SECS`).
    pub topup_action_timeout: Duration,
    /// Webhook delivery (docs/webhooks.md, `ONCEPAY_WEBHOOK_*`).
    pub webhooks: WebhookSettings,
}

/// A processor speaking Stripe's API (`ONCEPAY_PROCESSOR_URL`, `_API_KEY`, `_TIMEOUT_MS`,
/// `_NAME`).
#[derive(Clone)]
pub struct Processor {
    pub url: String,
    pub api_key: Option<String>,
    pub timeout: Duration,
    /// Who the top-ups made here belong to (`ONCEPAY_PROCESSOR_NAME`): recorded with each
    /// top-up, and the completer finishes only its own processor's. Defaults to
    /// [`Processor::derived_name`], so that another spelling of the same URL strands nothing.
    pub name: String,
}

impl Processor {
    /// The name of a processor account when `ONCEPAY_PROCESSOR_NAME` is unset: `key-` and the
    /// first 16 hexadecimal digits of the SHA-256 of its API key (a secret key belongs to one
    /// account, in one mode), or, without a key, the URL's origin as a URL parser writes it
    /// (scheme, host in lower case, port unless the default). Neither depends on how the URL
    /// is spelled; rolling the key changes the first, which is why the start-up log names it.
    pub fn derived_name(url: &str, api_key: Option<&str>) -> String {
        use sha2::Digest as _;
        match api_key {
            Some(key) => format!("key-{}", &hex::encode(sha2::Sha256::digest(key.as_bytes()))[..16]),
            None => reqwest::Url::parse(url)
                .map(|u| u.origin().ascii_serialization())
                .unwrap_or_else(|_| url.to_ascii_lowercase()),
        }
    }
}

impl std::fmt::Debug for Processor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Processor")
            .field("url", &self.url)
            .field("api_key", &self.api_key.as_ref().map(|_| REDACTED))
            .field("timeout", &self.timeout)
            .field("name", &self.name)
            .finish()
    }
}

/// How this process stores webhook secrets and delivers events.
#[derive(Clone)]
pub struct WebhookSettings {
    /// `ONCEPAY_WEBHOOK_SECRET_KEY`: 32 bytes, base64; the key the endpoints' signing secrets
    /// are encrypted with in the database (docs/security.md). `None`: they are stored as they
    /// are (webhooks work; a warning at start-up says that a dump of the database could sign).
    pub secret_key: Option<[u8; 32]>,
    /// `ONCEPAY_WEBHOOK_RETRY_SCHEDULE`: the waits between a failed attempt and the next.
    pub retry_schedule: Vec<Duration>,
    /// `ONCEPAY_WEBHOOK_ALLOW_PRIVATE=1`: loopback, private and link-local targets allowed.
    pub allow_private: bool,
    /// `ONCEPAY_WEBHOOK_TIMEOUT_MS` (15000): an attempt's longest wait for a 2xx.
    pub timeout: Duration,
    /// `ONCEPAY_WEBHOOK_CONCURRENCY` (64): attempts in flight in this process; 0: this
    /// process delivers nothing (other replicas do).
    pub concurrency: usize,
    /// `ONCEPAY_WEBHOOK_ENDPOINT_CONCURRENCY` (16): attempts in flight to one endpoint, over
    /// every replica.
    pub endpoint_concurrency: u32,
    /// `ONCEPAY_WEBHOOK_POLL_MS` (250): how often an idle worker looks for due deliveries.
    pub poll: Duration,
    /// `ONCEPAY_WEBHOOK_DISABLE_AFTER_SECS` (432000, five days): an endpoint none of whose
    /// attempts succeeded for this long, while attempts kept failing, is disabled.
    pub disable_after: Duration,
    /// `ONCEPAY_WEBHOOK_MAX_ENDPOINTS` (16): endpoints per tenant (deleted ones not counted).
    pub max_endpoints: u32,
    /// `ONCEPAY_WEBHOOK_RECOVERY_SLICE` (5000): deliveries a recovery changes in one
    /// transaction (migrations/V51): how long it holds them, and their endpoint, at once.
    pub recovery_slice: u32,
}

/// `5,300,1800,7200,18000,36000,36000`: README.md, Settings.
pub const DEFAULT_RETRY_SCHEDULE: &str = "5,300,1800,7200,18000,36000,36000";

impl WebhookSettings {
    fn from_env() -> anyhow::Result<Self> {
        use base64::Engine as _;
        let secret_key = match var("ONCEPAY_WEBHOOK_SECRET_KEY").filter(|k| !k.trim().is_empty()) {
            None => None,
            Some(raw) => {
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(raw.trim())
                    .ok()
                    .and_then(|b| <[u8; 32]>::try_from(b).ok())
                    .context(
                        "ONCEPAY_WEBHOOK_SECRET_KEY must be 32 bytes in base64 (`head -c 32 /dev/urandom | base64`)",
                    )?;
                Some(bytes)
            }
        };
        let raw_schedule = var("ONCEPAY_WEBHOOK_RETRY_SCHEDULE").unwrap_or_else(|| DEFAULT_RETRY_SCHEDULE.to_owned());
        Ok(Self {
            secret_key,
            retry_schedule: parse_schedule(&raw_schedule)?,
            allow_private: switch("ONCEPAY_WEBHOOK_ALLOW_PRIVATE")?,
            timeout: Duration::from_millis(number("ONCEPAY_WEBHOOK_TIMEOUT_MS", 15_000)?),
            concurrency: number("ONCEPAY_WEBHOOK_CONCURRENCY", 64)?,
            endpoint_concurrency: number("ONCEPAY_WEBHOOK_ENDPOINT_CONCURRENCY", 16)?,
            poll: Duration::from_millis(number("ONCEPAY_WEBHOOK_POLL_MS", 250)?),
            disable_after: Duration::from_secs(number("ONCEPAY_WEBHOOK_DISABLE_AFTER_SECS", 432_000)?),
            max_endpoints: number("ONCEPAY_WEBHOOK_MAX_ENDPOINTS", 16)?,
            recovery_slice: number("ONCEPAY_WEBHOOK_RECOVERY_SLICE", 5_000)?,
        })
    }

    /// The longest pause between two attempts to an endpoint that keeps failing with something
    /// left to retry: an attempt's timeout, the schedule's longest wait with its jitter (up
    /// to +10 %), a poll, and a second's margin. A longer pause with no attempt ends a failing
    /// stretch (migrations/V31): nothing was being retried, the endpoint was quiet, not
    /// failing. 39,617 s (11 h) with the defaults.
    pub fn failing_pause(&self) -> Duration {
        let longest = self.retry_schedule.iter().max().copied().unwrap_or_default();
        self.timeout + longest.mul_f64(1.1) + self.poll + Duration::from_secs(1)
    }
}

/// Seconds, comma-separated, as in `ONCEPAY_WEBHOOK_RETRY_SCHEDULE` (fractions allowed, for
/// tests); at least one, each positive.
pub fn parse_schedule(raw: &str) -> anyhow::Result<Vec<Duration>> {
    raw.split(',')
        .map(|part| {
            part.trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e7)
                .map(Duration::from_secs_f64)
                .with_context(|| {
                    format!("ONCEPAY_WEBHOOK_RETRY_SCHEDULE={raw:?}: {part:?} is not a positive number of seconds")
                })
        })
        .collect()
}

/// What stands between oncepay and PostgreSQL (README.md, Settings, `ONCEPAY_DB_POOLER`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooler {
    /// Direct connections (or a session-mode pooler): session settings and named prepared
    /// statements are kept per connection.
    None,
    /// A transaction-mode pooler (PgBouncer `pool_mode = transaction`): every call is its own
    /// transaction, with no named prepared statement or session setting outliving it.
    Transaction,
}

impl Settings {
    /// How long a graceful stop (SIGTERM) waits for the requests in flight: the longest a
    /// payment waits for a slot, runs and is answered. A request cut before its statement
    /// ended could commit after the process left, unanswered (found from outside: one waiting
    /// on a row lock committed 3.3 s after a drain of 10 s ended), so the drain outlasts it.
    pub fn drain(&self) -> Duration {
        self.db_acquire_timeout + self.statement_timeout + DRAIN_MARGIN
    }

    /// Reads the settings; `DATABASE_URL` is the one required variable.
    pub fn from_env() -> anyhow::Result<Self> {
        let database_url = std::env::var("DATABASE_URL")
            .context("DATABASE_URL is not set (make targets set it to the local cluster)")?;
        Self::from_env_with_database(database_url)
    }

    /// Like [`Settings::from_env`] with the database given; tests use it.
    pub fn from_env_with_database(database_url: String) -> anyhow::Result<Self> {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let workers = number("ONCEPAY_WORKERS", cores)?;
        let settings = Self {
            database_url,
            bind: var("ONCEPAY_BIND").unwrap_or_else(|| "127.0.0.1:8130".to_owned()),
            metrics_bind: var("ONCEPAY_METRICS_BIND").unwrap_or_else(|| "127.0.0.1:9130".to_owned()),
            admin_token: var("ONCEPAY_ADMIN_TOKEN").filter(|t| !t.is_empty()),
            replay_window: Duration::from_secs(number("ONCEPAY_REPLAY_WINDOW_SECS", 86_400)?),
            retention: Duration::from_secs(number("ONCEPAY_RETENTION_SECS", 604_800)?),
            event_retention: Duration::from_secs(
                number::<u64>("ONCEPAY_EVENT_RETENTION_DAYS", 30)?.saturating_mul(86_400),
            ),
            inflight_wait: Duration::from_millis(number("ONCEPAY_INFLIGHT_WAIT_MS", 5_000)?),
            fingerprint_window: Duration::from_secs(number("ONCEPAY_FINGERPRINT_WINDOW_SECS", 60)?),
            max_body_bytes: number("ONCEPAY_MAX_BODY_BYTES", 65_536)?,
            // Group commit needs several connections in flight per core; measured in docs/bench.
            db_pool_size: number("ONCEPAY_DB_POOL_SIZE", (cores as u32 * 8).clamp(4, 64))?,
            db_pooler: match var("ONCEPAY_DB_POOLER").as_deref().map(str::trim) {
                None | Some("none") => Pooler::None,
                Some("transaction") => Pooler::Transaction,
                Some(other) => bail!("ONCEPAY_DB_POOLER={other:?} is not one of: none, transaction"),
            },
            db_acquire_timeout: Duration::from_millis(number("ONCEPAY_DB_ACQUIRE_TIMEOUT_MS", 2_000)?),
            statement_timeout: Duration::from_millis(number("ONCEPAY_STATEMENT_TIMEOUT_MS", 15_000)?),
            // Measured in docs/bench/analysis.md ("Payments in batches").
            db_batch_max: number("ONCEPAY_DB_BATCH_MAX", 32)?,
            db_batches_in_flight: optional_number("ONCEPAY_DB_BATCHES_IN_FLIGHT")?,
            db_batches_initial: cores.clamp(2, 8),
            // Two payments in flight per core keep a core busy; measured in docs/bench/README.md
            // ("Noisy neighbour").
            db_tenant_share: number("ONCEPAY_DB_TENANT_SHARE", (cores * 2).clamp(4, 32))?,
            purge_interval: match number::<u64>("ONCEPAY_PURGE_INTERVAL_SECS", 0)? {
                0 => None,
                secs => Some(Duration::from_secs(secs)),
            },
            purge_batch_size: number("ONCEPAY_PURGE_BATCH_SIZE", 5_000)?,
            workers,
            max_connections: number(
                "ONCEPAY_MAX_CONNECTIONS",
                workers.saturating_mul(CONNECTIONS_PER_WORKER),
            )?,
            max_connections_per_peer: number("ONCEPAY_MAX_CONNECTIONS_PER_PEER", 0)?,
            log_json: parse_log_format(var("ONCEPAY_LOG_FORMAT").as_deref())?,
            // About 0.5 KB an entry: 100,000 entries hold a day of keys at ~1 key/s per
            // replica, or the last few minutes of a busy one, in ~50 MB.
            replay_cache_entries: number("ONCEPAY_REPLAY_CACHE_ENTRIES", 100_000)?,
            tls_cert: var("ONCEPAY_TLS_CERT").filter(|p| !p.is_empty()).map(PathBuf::from),
            tls_key: var("ONCEPAY_TLS_KEY").filter(|p| !p.is_empty()).map(PathBuf::from),
            processor: match var("ONCEPAY_PROCESSOR_URL").filter(|u| !u.trim().is_empty()) {
                None => None,
                Some(url) => {
                    let url = url.trim().trim_end_matches('/').to_owned();
                    let api_key = var("ONCEPAY_PROCESSOR_API_KEY").filter(|k| !k.is_empty());
                    let name = var("ONCEPAY_PROCESSOR_NAME")
                        .map(|n| n.trim().to_owned())
                        .filter(|n| !n.is_empty())
                        .unwrap_or_else(|| Processor::derived_name(&url, api_key.as_deref()));
                    Some(Processor {
                        url,
                        api_key,
                        timeout: Duration::from_millis(number("ONCEPAY_PROCESSOR_TIMEOUT_MS", 10_000)?),
                        name,
                    })
                }
            },
            currency: var("ONCEPAY_CURRENCY")
                .map(|c| c.trim().to_ascii_lowercase())
                .unwrap_or_else(|| "usd".to_owned()),
            completer_after: Duration::from_secs(number("ONCEPAY_COMPLETER_AFTER_SECS", 30)?),
            topup_action_timeout: Duration::from_secs(number("ONCEPAY_TOPUP_ACTION_TIMEOUT_SECS", 600)?),
            webhooks: WebhookSettings::from_env()?,
        };
        settings.validate()?;
        Ok(settings)
    }

    fn validate(&self) -> anyhow::Result<()> {
        if self.replay_window.is_zero() || self.fingerprint_window.is_zero() {
            bail!("ONCEPAY_REPLAY_WINDOW_SECS and ONCEPAY_FINGERPRINT_WINDOW_SECS must be positive");
        }
        if self.retention.as_secs() > MAX_RETENTION_SECS {
            bail!(
                "ONCEPAY_RETENTION_SECS={} is more than the {MAX_RETENTION_SECS} (ten years) a key can be kept",
                self.retention.as_secs()
            );
        }
        if self.retention < self.replay_window {
            bail!("ONCEPAY_RETENTION_SECS must be at least ONCEPAY_REPLAY_WINDOW_SECS: a key purged while it still replays would be processed twice");
        }
        if self.replay_window.as_secs() > i32::MAX as u64 || self.fingerprint_window.as_secs() > i32::MAX as u64 {
            bail!("replay windows above {} seconds are not supported", i32::MAX);
        }
        if self.event_retention.is_zero() || self.event_retention.as_secs() > 3_650 * 86_400 {
            bail!("ONCEPAY_EVENT_RETENTION_DAYS must be between 1 and 3650");
        }
        if self.statement_timeout.as_millis() > i32::MAX as u128 {
            bail!(
                "ONCEPAY_STATEMENT_TIMEOUT_MS={} is more than PostgreSQL's largest statement_timeout, {} ms",
                self.statement_timeout.as_millis(),
                i32::MAX
            );
        }
        if self.db_acquire_timeout.is_zero() {
            bail!(
                "ONCEPAY_DB_ACQUIRE_TIMEOUT_MS must be positive: it is also the time a new connection is given to open"
            );
        }
        if self.inflight_wait.is_zero() || self.statement_timeout <= self.inflight_wait {
            bail!("ONCEPAY_STATEMENT_TIMEOUT_MS must exceed ONCEPAY_INFLIGHT_WAIT_MS, which must be positive");
        }
        if self.db_batch_max == 0 || self.db_batch_max > 1_000 {
            bail!("ONCEPAY_DB_BATCH_MAX must be between 1 and 1000");
        }
        if let Some(n) = self.db_batches_in_flight {
            if n == 0 || n > self.db_pool_size as usize {
                bail!(
                    "ONCEPAY_DB_BATCHES_IN_FLIGHT={n} must be between 1 and ONCEPAY_DB_POOL_SIZE ({}): each statement in flight holds a connection",
                    self.db_pool_size
                );
            }
        }
        if self.db_pool_size > MAX_DB_POOL_SIZE {
            bail!(
                "ONCEPAY_DB_POOL_SIZE={} is more than {MAX_DB_POOL_SIZE}: PostgreSQL serves each connection with a \
                 process of its own (its max_connections is usually a few hundred)",
                self.db_pool_size
            );
        }
        for (name, positive) in [
            ("ONCEPAY_DB_POOL_SIZE", self.db_pool_size > 0),
            ("ONCEPAY_WORKERS", self.workers > 0),
            ("ONCEPAY_MAX_BODY_BYTES", self.max_body_bytes > 0),
            ("ONCEPAY_PURGE_BATCH_SIZE", self.purge_batch_size > 0),
        ] {
            if !positive {
                bail!("{name} must be positive");
            }
        }
        if self.workers > MAX_WORKERS {
            bail!(
                "ONCEPAY_WORKERS={} is more than the {MAX_WORKERS} HTTP workers the server can run (one thread each)",
                self.workers
            );
        }
        if self.max_connections == 0 {
            bail!("ONCEPAY_MAX_CONNECTIONS must be at least 1 (open connections per process)");
        }
        if self.webhooks.timeout.is_zero() || self.webhooks.endpoint_concurrency == 0 || self.webhooks.poll.is_zero() {
            bail!("ONCEPAY_WEBHOOK_TIMEOUT_MS, ONCEPAY_WEBHOOK_ENDPOINT_CONCURRENCY and ONCEPAY_WEBHOOK_POLL_MS must be positive");
        }
        // Past these a deliverer stopped at its start (too many attempts for a semaphore), or
        // never looked again (a poll of years), or panicked at its first attempt's deadline.
        if self.webhooks.concurrency > MAX_WEBHOOK_CONCURRENCY {
            bail!("ONCEPAY_WEBHOOK_CONCURRENCY must be at most {MAX_WEBHOOK_CONCURRENCY} attempts in flight");
        }
        if self.webhooks.timeout > MAX_WEBHOOK_TIMEOUT {
            bail!(
                "ONCEPAY_WEBHOOK_TIMEOUT_MS must be at most {} (five minutes): an attempt holds its delivery and a \
                 slot while it waits (receivers are expected to answer within seconds)",
                MAX_WEBHOOK_TIMEOUT.as_millis()
            );
        }
        if self.webhooks.poll > MAX_WEBHOOK_POLL {
            bail!(
                "ONCEPAY_WEBHOOK_POLL_MS must be at most {} (a minute): a due delivery can wait this long for an idle worker",
                MAX_WEBHOOK_POLL.as_millis()
            );
        }
        if self.webhooks.max_endpoints == 0 || self.webhooks.max_endpoints > 1_000 {
            bail!("ONCEPAY_WEBHOOK_MAX_ENDPOINTS must be between 1 and 1000");
        }
        if self.webhooks.recovery_slice == 0 || self.webhooks.recovery_slice > 1_000_000 {
            bail!(
                "ONCEPAY_WEBHOOK_RECOVERY_SLICE must be between 1 and 1000000 deliveries (a recovery's \
                 transaction; 5,000 take 0.1-0.2 s)"
            );
        }
        if self.webhooks.disable_after.is_zero() || self.webhooks.disable_after.as_secs() > i32::MAX as u64 {
            bail!(
                "ONCEPAY_WEBHOOK_DISABLE_AFTER_SECS must be between 1 and {}: at 0 an endpoint's first failed \
                 attempt would disable it",
                i32::MAX
            );
        }
        if let Some(token) = &self.admin_token {
            if !token.bytes().all(|b| b.is_ascii_graphic()) {
                bail!(
                    "ONCEPAY_ADMIN_TOKEN must be visible ASCII characters without spaces: HTTP drops the spaces around \
                     a header's value, so a token with them could never be sent"
                );
            }
            let length = token.chars().count();
            if length < MIN_ADMIN_TOKEN_CHARS {
                bail!(
                    "ONCEPAY_ADMIN_TOKEN is {length} characters long; it must have at least {MIN_ADMIN_TOKEN_CHARS} \
                     (e.g. `head -c 24 /dev/urandom | base64`)"
                );
            }
        }
        if self.currency.len() != 3 || !self.currency.bytes().all(|b| b.is_ascii_lowercase()) {
            bail!(
                "ONCEPAY_CURRENCY={:?} is not a three-letter ISO currency code",
                self.currency
            );
        }
        if let Some(processor) = &self.processor {
            if !(processor.url.starts_with("http://") || processor.url.starts_with("https://")) {
                bail!("ONCEPAY_PROCESSOR_URL must be an http:// or https:// URL");
            }
            if processor.timeout.is_zero() {
                bail!("ONCEPAY_PROCESSOR_TIMEOUT_MS must be positive");
            }
            if processor.name.is_empty()
                || processor.name.len() > MAX_PROCESSOR_NAME_LEN
                || !processor.name.bytes().all(|b| b.is_ascii_graphic())
            {
                bail!(
                    "ONCEPAY_PROCESSOR_NAME={:?} must be 1 to {MAX_PROCESSOR_NAME_LEN} visible ASCII characters",
                    processor.name
                );
            }
        }
        if self.completer_after.is_zero() || self.completer_after.as_secs() > i32::MAX as u64 {
            bail!("ONCEPAY_COMPLETER_AFTER_SECS must be positive");
        }
        if self.topup_action_timeout.is_zero() || self.topup_action_timeout.as_secs() > i32::MAX as u64 {
            bail!("ONCEPAY_TOPUP_ACTION_TIMEOUT_SECS must be a positive number of seconds");
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => {
                bail!("ONCEPAY_TLS_CERT is set but ONCEPAY_TLS_KEY is not: set both to serve HTTPS, or neither")
            }
            (None, Some(_)) => {
                bail!("ONCEPAY_TLS_KEY is set but ONCEPAY_TLS_CERT is not: set both to serve HTTPS, or neither")
            }
            _ => Ok(()),
        }
    }
}

const REDACTED: &str = "<redacted>";

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Destructured, so that a new field cannot be left out (or shown) unnoticed.
        let Self {
            database_url,
            bind,
            metrics_bind,
            admin_token,
            replay_window,
            retention,
            event_retention,
            inflight_wait,
            fingerprint_window,
            max_body_bytes,
            db_pool_size,
            db_acquire_timeout,
            statement_timeout,
            db_batch_max,
            db_batches_in_flight,
            db_batches_initial,
            db_tenant_share,
            purge_interval,
            purge_batch_size,
            workers,
            max_connections,
            max_connections_per_peer,
            log_json,
            replay_cache_entries,
            tls_cert,
            tls_key,
            db_pooler,
            processor,
            currency,
            completer_after,
            topup_action_timeout,
            webhooks,
        } = self;
        f.debug_struct("Settings")
            .field("database_url", &redacted_url(database_url))
            .field("bind", bind)
            .field("metrics_bind", metrics_bind)
            .field("admin_token", &admin_token.as_ref().map(|_| REDACTED))
            .field("replay_window", replay_window)
            .field("retention", retention)
            .field("event_retention", event_retention)
            .field("inflight_wait", inflight_wait)
            .field("fingerprint_window", fingerprint_window)
            .field("max_body_bytes", max_body_bytes)
            .field("db_pool_size", db_pool_size)
            .field("db_acquire_timeout", db_acquire_timeout)
            .field("statement_timeout", statement_timeout)
            .field("db_batch_max", db_batch_max)
            .field("db_batches_in_flight", db_batches_in_flight)
            .field("db_batches_initial", db_batches_initial)
            .field("db_tenant_share", db_tenant_share)
            .field("purge_interval", purge_interval)
            .field("purge_batch_size", purge_batch_size)
            .field("workers", workers)
            .field("max_connections", max_connections)
            .field("max_connections_per_peer", max_connections_per_peer)
            .field("log_json", log_json)
            .field("replay_cache_entries", replay_cache_entries)
            .field("tls_cert", tls_cert)
            .field("tls_key", tls_key)
            .field("db_pooler", db_pooler)
            .field("processor", processor)
            .field("currency", currency)
            .field("completer_after", completer_after)
            .field("topup_action_timeout", topup_action_timeout)
            .field("webhook_secret_key", &webhooks.secret_key.as_ref().map(|_| REDACTED))
            .field("webhook_retry_schedule", &webhooks.retry_schedule)
            .field("webhook_allow_private", &webhooks.allow_private)
            .field("webhook_timeout", &webhooks.timeout)
            .field("webhook_concurrency", &webhooks.concurrency)
            .field("webhook_endpoint_concurrency", &webhooks.endpoint_concurrency)
            .field("webhook_poll", &webhooks.poll)
            .field("webhook_disable_after", &webhooks.disable_after)
            .field("webhook_max_endpoints", &webhooks.max_endpoints)
            .finish()
    }
}

/// The URL with its password (in the user part or as `?password=`) replaced; a URL that does
/// not parse is not shown at all, since where its password sits is unknown.
fn redacted_url(raw: &str) -> String {
    let Ok(mut url) = reqwest::Url::parse(raw) else {
        return REDACTED.to_owned();
    };
    if url.password().is_some() && url.set_password(Some(REDACTED)).is_err() {
        return REDACTED.to_owned();
    }
    if url.query_pairs().any(|(name, _)| name == "password") {
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(name, value)| {
                let value = if name == "password" { REDACTED.into() } else { value };
                (name.into_owned(), value.into_owned())
            })
            .collect();
        url.query_pairs_mut().clear().extend_pairs(pairs);
    }
    url.to_string()
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// A number, or `None` when the variable is unset or empty (blank), as for switches and the
/// log format.
fn optional_number<T: std::str::FromStr>(name: &str) -> anyhow::Result<Option<T>> {
    parse_number(name, var(name).as_deref())
}

fn number<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T> {
    Ok(optional_number(name)?.unwrap_or(default))
}

fn parse_number<T: std::str::FromStr>(name: &str, raw: Option<&str>) -> anyhow::Result<Option<T>> {
    match raw.map(str::trim).filter(|raw| !raw.is_empty()) {
        None => Ok(None),
        Some(raw) => raw.parse().map(Some).map_err(|_| not_a_number(name, raw)),
    }
}

/// `ONCEPAY_LOG_FORMAT`: `text` (unset or empty too) or `json`, in any case; whether it is JSON.
fn parse_log_format(raw: Option<&str>) -> anyhow::Result<bool> {
    match raw.map(str::trim) {
        None | Some("") => Ok(false),
        Some(f) if f.eq_ignore_ascii_case("text") => Ok(false),
        Some(f) if f.eq_ignore_ascii_case("json") => Ok(true),
        Some(other) => bail!("ONCEPAY_LOG_FORMAT={other:?} is not one of: text, json"),
    }
}

fn not_a_number(name: &str, raw: &str) -> anyhow::Error {
    anyhow::anyhow!("{name}={raw:?} is not a valid non-negative whole number (or is too large for it)")
}

/// A yes-or-no setting: `1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off` (any case); unset
/// or empty is no.
fn switch(name: &str) -> anyhow::Result<bool> {
    parse_switch(name, var(name).as_deref())
}

fn parse_switch(name: &str, raw: Option<&str>) -> anyhow::Result<bool> {
    match raw.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None | Some("" | "0" | "false" | "no" | "off") => Ok(false),
        Some("1" | "true" | "yes" | "on") => Ok(true),
        Some(other) => bail!("{name}={other:?} is not one of: 1, true, yes, on, 0, false, no, off"),
    }
}

/// The `ONCEPAY_*` variables oncepay, its CLI and its scripts read; any other is reported at
/// start-up as probably misspelled ([`unknown_variables`]).
const KNOWN_VARIABLES: &[&str] = &[
    "ONCEPAY_ADMIN_TOKEN",
    "ONCEPAY_API_KEY",
    "ONCEPAY_BIND",
    // Read by build.rs; cargo sets it when it runs the tests, an image may keep it as ENV.
    "ONCEPAY_BUILD_COMMIT",
    "ONCEPAY_CA_CERT",
    "ONCEPAY_COMPLETER_AFTER_SECS",
    "ONCEPAY_CURRENCY",
    "ONCEPAY_DB_ACQUIRE_TIMEOUT_MS",
    "ONCEPAY_DB_BATCHES_IN_FLIGHT",
    "ONCEPAY_DB_BATCH_MAX",
    "ONCEPAY_DB_POOLER",
    "ONCEPAY_DB_POOL_SIZE",
    "ONCEPAY_DB_TENANT_SHARE",
    "ONCEPAY_EVENT_RETENTION_DAYS",
    "ONCEPAY_FINGERPRINT_WINDOW_SECS",
    "ONCEPAY_INFLIGHT_WAIT_MS",
    "ONCEPAY_LOG_FORMAT",
    "ONCEPAY_MAX_BODY_BYTES",
    "ONCEPAY_MAX_CONNECTIONS",
    "ONCEPAY_MAX_CONNECTIONS_PER_PEER",
    "ONCEPAY_METRICS_BIND",
    "ONCEPAY_PROCESSOR_API_KEY",
    "ONCEPAY_PROCESSOR_NAME",
    "ONCEPAY_PROCESSOR_TIMEOUT_MS",
    "ONCEPAY_PROCESSOR_URL",
    "ONCEPAY_PURGE_BATCH_SIZE",
    "ONCEPAY_PURGE_INTERVAL_SECS",
    "ONCEPAY_REPLAY_CACHE_ENTRIES",
    "ONCEPAY_REPLAY_WINDOW_SECS",
    "ONCEPAY_RETENTION_SECS",
    "ONCEPAY_STATEMENT_TIMEOUT_MS",
    "ONCEPAY_TLS_CERT",
    "ONCEPAY_TLS_KEY",
    "ONCEPAY_TOPUP_ACTION_TIMEOUT_SECS",
    "ONCEPAY_URL",
    "ONCEPAY_URLS",
    "ONCEPAY_WEBHOOK_ALLOW_PRIVATE",
    "ONCEPAY_WEBHOOK_CONCURRENCY",
    "ONCEPAY_WEBHOOK_DISABLE_AFTER_SECS",
    "ONCEPAY_WEBHOOK_ENDPOINT_CONCURRENCY",
    "ONCEPAY_WEBHOOK_MAX_ENDPOINTS",
    "ONCEPAY_WEBHOOK_POLL_MS",
    "ONCEPAY_WEBHOOK_RECOVERY_SLICE",
    "ONCEPAY_WEBHOOK_RETRY_SCHEDULE",
    "ONCEPAY_WEBHOOK_SECRET_KEY",
    "ONCEPAY_WEBHOOK_TIMEOUT_MS",
    "ONCEPAY_WORKERS",
    // The Makefile's and the scripts' own (docs/lab.md, README.md).
    "ONCEPAY_BIN",
    "ONCEPAY_CHAOS_DATABASE_URL",
    "ONCEPAY_LOCALSTRIPE",
    "ONCEPAY_LOCALSTRIPE_PORT",
    "ONCEPAY_PGBOUNCER_PORT",
    "ONCEPAY_PGDATA",
    "ONCEPAY_PG_PORT",
    "ONCEPAY_PG_STOP_MODE",
    "ONCEPAY_SWH_VENV",
    "ONCEPAY_TENANT_ID",
];

/// Prefixes of the scripts' and the tests' families of variables.
const KNOWN_PREFIXES: &[&str] = &["ONCEPAY_HA_", "ONCEPAY_TEST_", "ONCEPAY_BENCH_"];

/// The names among `names` that look like oncepay's (`ONCEPAY_...`) but that nothing of it
/// reads: a misspelled setting is otherwise silently left at its default.
pub fn unknown_variables(names: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut unknown: Vec<String> = names
        .into_iter()
        .filter(|name| name.starts_with("ONCEPAY_"))
        .filter(|name| !KNOWN_VARIABLES.contains(&name.as_str()))
        .filter(|name| !KNOWN_PREFIXES.iter().any(|prefix| name.starts_with(prefix)))
        .collect();
    unknown.sort();
    unknown
}

/// What a graceful stop's drain adds to a payment's longest wait and statement: its answer.
const DRAIN_MARGIN: Duration = Duration::from_secs(1);

/// The largest `ONCEPAY_DB_POOL_SIZE`: far above what one PostgreSQL serves, low enough to
/// catch a mistyped number (4294967295 started without a word).
pub const MAX_DB_POOL_SIZE: u32 = 10_000;

/// The most `ONCEPAY_WORKERS` (actix-server's limit: past it, a panic at start).
pub const MAX_WORKERS: usize = 512;

/// The most `ONCEPAY_WEBHOOK_CONCURRENCY`.
pub const MAX_WEBHOOK_CONCURRENCY: usize = 10_000;

/// The longest `ONCEPAY_WEBHOOK_TIMEOUT_MS`.
pub const MAX_WEBHOOK_TIMEOUT: Duration = Duration::from_secs(300);

/// The longest `ONCEPAY_WEBHOOK_POLL_MS`.
pub const MAX_WEBHOOK_POLL: Duration = Duration::from_secs(60);

/// The longest `ONCEPAY_RETENTION_SECS`: ten years (the purge computes `now()` minus it).
pub const MAX_RETENTION_SECS: u64 = 10 * 365 * 86_400;

/// Connections one worker serves by default: `ONCEPAY_MAX_CONNECTIONS` is this times
/// `ONCEPAY_WORKERS` unless set (the fixed limit per worker before it was a setting).
pub const CONNECTIONS_PER_WORKER: usize = 4_096;

/// The longest `ONCEPAY_PROCESSOR_NAME`: it is stored with every top-up.
pub const MAX_PROCESSOR_NAME_LEN: usize = 100;

/// The shortest admin token `serve` accepts: a guessable operator credential opens every
/// tenant's settings and the purge.
pub const MIN_ADMIN_TOKEN_CHARS: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_failing_pause_is_what_v31_gives_the_previous_version() {
        let webhooks = settings("postgres://localhost/x", None).webhooks;
        assert_eq!(webhooks.retry_schedule, parse_schedule(DEFAULT_RETRY_SCHEDULE).unwrap());
        // migrations/V31's wrapper for replicas of the previous version passes 39617.
        assert_eq!(webhooks.failing_pause().as_secs_f64().ceil(), 39_617.0);
    }

    fn settings(database_url: &str, admin_token: Option<&str>) -> Settings {
        let mut settings = Settings::from_env_with_database(database_url.to_owned()).unwrap();
        settings.admin_token = admin_token.map(str::to_owned);
        settings
    }

    #[test]
    fn an_admin_token_shorter_than_32_characters_is_refused_naming_the_variable() {
        let base = settings("postgres://oncepay@127.0.0.1:25130/oncepay", None);
        let with = |token: &str| Settings {
            admin_token: Some(token.to_owned()),
            ..base.clone()
        };
        let err = with(&"x".repeat(31)).validate().unwrap_err().to_string();
        assert!(err.contains("ONCEPAY_ADMIN_TOKEN") && err.contains("31"), "{err}");
        assert!(with(&"x".repeat(32)).validate().is_ok());
        assert!(base.validate().is_ok(), "unset: the admin API is off, nothing to check");
    }

    #[test]
    fn the_connection_limit_defaults_to_4096_per_worker_and_zero_is_refused_naming_it() {
        let base = settings("postgres://oncepay@127.0.0.1:25130/oncepay", None);
        if std::env::var_os("ONCEPAY_MAX_CONNECTIONS").is_none() {
            assert_eq!(base.max_connections, base.workers * CONNECTIONS_PER_WORKER);
        }
        let with = |max_connections: usize| Settings {
            max_connections,
            ..base.clone()
        };
        assert!(with(1).validate().is_ok());
        let err = with(0).validate().unwrap_err().to_string();
        assert!(err.contains("ONCEPAY_MAX_CONNECTIONS"), "{err}");
    }

    #[test]
    fn batch_settings_out_of_range_are_refused() {
        let base = settings("postgres://oncepay@127.0.0.1:25130/oncepay", None);
        assert!(base.validate().is_ok());
        let with = |max: usize, in_flight: Option<usize>| Settings {
            db_batch_max: max,
            db_batches_in_flight: in_flight,
            ..base.clone()
        };
        assert!(with(1, Some(1)).validate().is_ok(), "1: each payment alone");
        assert!(with(1_000, Some(8)).validate().is_ok());
        assert!(with(32, None).validate().is_ok(), "unset: chosen by the batcher");
        for (max, in_flight) in [(0, Some(2)), (1_001, Some(2))] {
            let err = with(max, in_flight).validate().unwrap_err().to_string();
            assert!(err.contains("ONCEPAY_DB_BATCH_MAX"), "{max}/{in_flight:?}: {err}");
        }
        // More than the pool's connections (once a semaphore's panic: usize::MAX).
        for in_flight in [0, base.db_pool_size as usize + 1, usize::MAX] {
            let err = with(32, Some(in_flight)).validate().unwrap_err().to_string();
            assert!(err.contains("ONCEPAY_DB_BATCHES_IN_FLIGHT"), "{in_flight}: {err}");
        }
        assert!(with(32, Some(base.db_pool_size as usize)).validate().is_ok());
    }

    #[test]
    fn settings_no_server_could_work_with_are_refused_naming_the_variable() {
        let base = settings("postgres://oncepay@127.0.0.1:25130/oncepay", None);
        let refused = |changed: Settings, name: &str| {
            let err = changed.validate().unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
        };
        // Each of these started, then answered "cannot reach the database" for ever, or made
        // every purge fail ("timestamp out of range").
        refused(
            Settings {
                db_acquire_timeout: Duration::ZERO,
                ..base.clone()
            },
            "ONCEPAY_DB_ACQUIRE_TIMEOUT_MS",
        );
        refused(
            Settings {
                statement_timeout: Duration::from_millis(i32::MAX as u64 + 1),
                ..base.clone()
            },
            "ONCEPAY_STATEMENT_TIMEOUT_MS",
        );
        refused(
            Settings {
                retention: Duration::from_secs(MAX_RETENTION_SECS + 1),
                ..base.clone()
            },
            "ONCEPAY_RETENTION_SECS",
        );
        refused(
            Settings {
                admin_token: Some(" ".repeat(32)),
                ..base.clone()
            },
            "ONCEPAY_ADMIN_TOKEN",
        );
        for slice in [0, 1_000_001] {
            let mut changed = base.clone();
            changed.webhooks.recovery_slice = slice;
            refused(changed, "ONCEPAY_WEBHOOK_RECOVERY_SLICE");
        }
        refused(
            Settings {
                workers: 0,
                ..base.clone()
            },
            "ONCEPAY_WORKERS",
        );
        let webhooks = |change: &dyn Fn(&mut WebhookSettings)| {
            let mut webhooks = base.webhooks.clone();
            change(&mut webhooks);
            Settings {
                webhooks,
                ..base.clone()
            }
        };
        // These started without a word: a pool no database serves, and endpoints disabled
        // at their first failed attempt.
        refused(
            Settings {
                db_pool_size: u32::MAX,
                ..base.clone()
            },
            "ONCEPAY_DB_POOL_SIZE",
        );
        refused(
            webhooks(&|w| w.disable_after = Duration::ZERO),
            "ONCEPAY_WEBHOOK_DISABLE_AFTER_SECS",
        );
        // These started and then panicked: the deliverer at once (a semaphore of usize::MAX
        // permits) while the server answered ready, actix at start (workers past 512), a
        // delivery at its deadline (a timeout of u64::MAX ms); a poll of years never looked.
        refused(
            Settings {
                workers: MAX_WORKERS + 1,
                ..base.clone()
            },
            "ONCEPAY_WORKERS",
        );
        refused(webhooks(&|w| w.concurrency = usize::MAX), "ONCEPAY_WEBHOOK_CONCURRENCY");
        refused(
            webhooks(&|w| w.timeout = Duration::from_millis(u64::MAX)),
            "ONCEPAY_WEBHOOK_TIMEOUT_MS",
        );
        refused(webhooks(&|w| w.poll = MAX_WEBHOOK_POLL * 2), "ONCEPAY_WEBHOOK_POLL_MS");
        assert!(webhooks(&|w| {
            w.concurrency = MAX_WEBHOOK_CONCURRENCY;
            w.timeout = MAX_WEBHOOK_TIMEOUT;
            w.poll = MAX_WEBHOOK_POLL;
        })
        .validate()
        .is_ok());
        assert!(Settings {
            db_pool_size: MAX_DB_POOL_SIZE,
            db_batches_in_flight: None,
            ..base.clone()
        }
        .validate()
        .is_ok());
        assert!(Settings {
            statement_timeout: Duration::from_millis(i32::MAX as u64),
            retention: Duration::from_secs(MAX_RETENTION_SECS),
            ..base
        }
        .validate()
        .is_ok());
    }

    #[test]
    fn an_empty_number_is_unset_like_an_empty_switch_and_words_are_refused_naming_the_variable() {
        assert_eq!(parse_number::<u32>("X", None).unwrap(), None);
        assert_eq!(parse_number::<u32>("X", Some("")).unwrap(), None);
        assert_eq!(parse_number::<u32>("X", Some("  ")).unwrap(), None);
        assert_eq!(parse_number::<u32>("X", Some(" 12 ")).unwrap(), Some(12));
        for bad in ["twelve", "-1", "1.5", "4294967296"] {
            let err = parse_number::<u32>("ONCEPAY_X", Some(bad)).unwrap_err().to_string();
            assert!(err.contains("ONCEPAY_X") && err.contains(bad), "{bad}: {err}");
        }
    }

    #[test]
    fn switches_and_the_log_format_take_their_words_and_refuse_others() {
        for on in ["1", "true", "TRUE", " yes ", "on"] {
            assert!(parse_switch("X", Some(on)).unwrap(), "{on}");
        }
        for off in ["0", "false", "no", "off", ""] {
            assert!(!parse_switch("X", Some(off)).unwrap(), "{off}");
        }
        assert!(!parse_switch("X", None).unwrap());
        let err = parse_switch("ONCEPAY_WEBHOOK_ALLOW_PRIVATE", Some("enabled"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("ONCEPAY_WEBHOOK_ALLOW_PRIVATE") && err.contains("enabled"),
            "{err}"
        );

        assert!(parse_log_format(Some("JSON")).unwrap());
        assert!(!parse_log_format(Some("text")).unwrap());
        assert!(!parse_log_format(None).unwrap());
        let err = parse_log_format(Some("yaml")).unwrap_err().to_string();
        assert!(err.contains("ONCEPAY_LOG_FORMAT") && err.contains("yaml"), "{err}");
    }

    #[test]
    fn every_variable_the_code_reads_is_known() {
        let config = include_str!("config.rs");
        let sources = [
            &config[..config.find("const KNOWN_VARIABLES").unwrap()],
            include_str!("startup.rs"),
            include_str!("tls.rs"),
            include_str!("../build.rs"),
            include_str!("../client/src/lib.rs"),
            include_str!("../client/src/cli.rs"),
        ];
        let mut read = 0;
        for source in sources {
            for (at, _) in source.match_indices("\"ONCEPAY_") {
                let name: String = source[at + 1..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                read += 1;
                assert!(
                    unknown_variables([name.clone()]).is_empty(),
                    "{name} is read but not known"
                );
            }
        }
        assert!(read > 40, "the sources name the variables they read: {read}");
    }

    #[test]
    fn an_oncepay_variable_nothing_reads_is_named_and_the_known_ones_are_not() {
        let names = [
            "ONCEPAY_REPLAY_WINDOW",
            "ONCEPAY_REPLAY_WINDOW_SECS",
            "ONCEPAY_PG_PORT",
            "ONCEPAY_TEST_LOCALSTRIPE",
            "ONCEPAY_HA_DIR",
            "PATH",
            "ONCEPAY_DB_POOL",
        ]
        .map(str::to_owned);
        assert_eq!(
            unknown_variables(names),
            vec!["ONCEPAY_DB_POOL".to_owned(), "ONCEPAY_REPLAY_WINDOW".to_owned()]
        );
    }

    #[test]
    fn debug_hides_the_database_password_and_the_admin_token() {
        let shown = format!(
            "{:?}",
            settings(
                "postgres://oncepay:s3cret-pw@db.internal:5432/oncepay?sslmode=require&password=other-pw",
                Some("admin-t0ken")
            )
        );

        for secret in ["s3cret-pw", "other-pw", "admin-t0ken"] {
            assert!(!shown.contains(secret), "{secret} shown in {shown}");
        }
        assert!(
            shown.contains(r#"database_url: "postgres://oncepay:%3Credacted%3E@db.internal:5432/oncepay?sslmode=require&password=%3Credacted%3E""#),
            "{shown}"
        );
        assert!(shown.contains(r#"admin_token: Some("<redacted>")"#), "{shown}");
    }

    #[test]
    fn debug_shows_what_is_not_secret() {
        let plain = settings("postgres://oncepay@127.0.0.1:25130/oncepay", None);

        let shown = format!("{plain:?}");

        assert!(
            shown.contains(r#"database_url: "postgres://oncepay@127.0.0.1:25130/oncepay""#),
            "{shown}"
        );
        assert!(shown.contains("admin_token: None"), "{shown}");
        for field in [
            format!("bind: {:?}", plain.bind),
            format!("replay_window: {:?}", plain.replay_window),
        ] {
            assert!(shown.contains(&field), "{field} not in {shown}");
        }
    }

    #[test]
    fn the_derived_processor_name_follows_the_account_not_the_spelling_of_its_url() {
        let key = Some("sk_test_4eC39HqLyjWDarjtT1zdp7dc");
        let named = Processor::derived_name("https://api.stripe.com", key);
        assert!(named.starts_with("key-") && named.len() == 20, "{named}");
        assert_eq!(Processor::derived_name("https://API.stripe.com:443/", key), named);
        assert_ne!(
            Processor::derived_name("https://api.stripe.com", Some("sk_test_other")),
            named
        );
        assert!(!named.contains("sk_test"), "the key itself is never shown");
        assert_eq!(
            Processor::derived_name("http://LOCALHOST:8420/", None),
            Processor::derived_name("http://localhost:8420", None)
        );
        assert_eq!(Processor::derived_name("http://localhost:80", None), "http://localhost");
    }

    #[test]
    fn debug_shows_no_part_of_a_url_that_does_not_parse() {
        let shown = format!("{:?}", settings("postgres://oncepay:pw@[bad/oncepay", None));

        assert!(shown.contains(r#"database_url: "<redacted>""#), "{shown}");
    }
}
