//! The PostgreSQL side, by subject: the pool ([`pool`]), a connection's calls ([`Conn`]),
//! the classes of database failure the layers above decide on ([`DbError`]), and the schema
//! (migrations, the version check).

mod conn;
mod error;
mod per_worker;
mod pool;
mod schema;
mod timestamptz;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use prometheus::IntCounterVec;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};

use crate::config::{Pooler, Settings};

pub use conn::Conn;
pub use error::DbError;
pub use per_worker::PerWorker;
pub use pool::PoolStatus;
pub use schema::{
    check_schema, embedded_migration_count, expected_schema_version, migrate, wait_for_schema, SchemaError,
};
pub use timestamptz::{Timestamptz, WireTimes};

use pool::{acquire, acquire_unlogged, pool, Pool};

/// Application name of the service's connections (visible in `pg_stat_activity`) unless
/// `DATABASE_URL` names one: an operator tells replicas apart by giving each its own
/// (`?application_name=oncepay-eu-2`), as with any libpq client.
pub const APPLICATION_NAME: &str = "oncepay";

/// How long a transaction may sit idle (a stalled process must not hold row locks).
const IDLE_IN_TRANSACTION: &str = "60s";

/// How long [`Db::close`] waits for the idle connections' goodbyes.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// How much longer than the statement timeout a call waits for PostgreSQL's answer before it
/// gives up on the connection ([`Session::deadline`]). PostgreSQL answers a statement past
/// its timeout itself (57014) within a moment; only a database that receives nothing, or
/// answers nothing (a network partition, a frozen host, a failover that leaves the old
/// primary's sockets open), lets a call reach this.
const ANSWER_MARGIN: Duration = Duration::from_secs(5);

/// The longest a health probe (`/readyz`, the scrape's `oncepay_ready`) waits for the
/// database: an answer later than a prober waits is no answer, and a database that holds the
/// query (PgBouncer's `PAUSE`, a partition) is not ready now. A quiet query on a healthy
/// primary takes milliseconds.
pub const PROBE_WITHIN: Duration = Duration::from_secs(2);

/// Whether the server `conn` reached takes writes: a primary, not set read-only. What
/// `/readyz` and the scrape's `oncepay_ready` both report (found from outside: the scrape
/// asked the key table instead, so a read-only database read ready 1 beside `/readyz`'s 503,
/// and a lock on that one table read 0 beside its 200). A connection to a server that does
/// not is dropped, so the next one (through a proxy) finds the new primary.
pub async fn writable(conn: &mut Conn) -> Result<bool, DbError> {
    let writable = conn
        .run(async |c| {
            sqlx::query_scalar::<_, bool>(
                "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'",
            )
            .fetch_one(c)
            .await
        })
        .await?;
    if !writable {
        conn.discard();
    }
    Ok(writable)
}

/// `DATABASE_URL` parsed, its refusal said once, and an `sslrootcert` that names no file
/// named at once (found from outside: sqlx's message for `sslmode=bogus` came three times,
/// through its error's sources, and a missing certificate file only at the first connection,
/// as "No such file or directory", without its path).
pub fn parse_url(database_url: &str) -> anyhow::Result<PgConnectOptions> {
    let options = PgConnectOptions::from_str(database_url).map_err(|err| {
        let mut innermost: &dyn std::error::Error = &err;
        while let Some(source) = innermost.source() {
            innermost = source;
        }
        anyhow::anyhow!("DATABASE_URL is not a valid PostgreSQL URL: {innermost}")
    })?;
    if let Ok(url) = reqwest::Url::parse(database_url) {
        if let Some((_, file)) = url.query_pairs().find(|(name, _)| name == "sslrootcert") {
            if file != "system" && !std::path::Path::new(file.as_ref()).is_file() {
                anyhow::bail!("DATABASE_URL's sslrootcert {file:?} names no file");
            }
        }
    }
    Ok(options)
}

/// The connection options for `settings.db_pooler`.
///
/// Every session runs with `jit = off`: oncepay's statements are short, and PostgreSQL's
/// JIT compiles a statement when its estimated cost is high, which a plan cached with
/// statistics of a large backlog can be for ever (found from outside: after a recovery of
/// 228,000 deliveries, every claim of one connection compiled for 0.5-0.8 s, reading 50-250
/// buffers, until the next ANALYZE; the other tenants' webhooks lagged 1 s instead of 0.1).
///
/// `none`: connections carry their statement timeout from the start-up packet, so no
/// request pays a round trip for a `SET`, and sqlx keeps each statement prepared (named)
/// per connection: one round trip per call.
///
/// `transaction`: a transaction-mode pooler refuses start-up options and hands each
/// transaction to any server connection, so the start-up packet carries nothing but the
/// application name, and no statement is cached: the settings travel in each call's
/// `BEGIN` instead (see [`Conn::run`]).
fn connect_options(settings: &Settings, extra: &[(&str, &str)]) -> anyhow::Result<PgConnectOptions> {
    let options = parse_url(&settings.database_url)?;
    let options = if options.get_application_name().is_some() {
        options
    } else {
        options.application_name(APPLICATION_NAME)
    };
    Ok(match settings.db_pooler {
        Pooler::None => options
            .options([
                (
                    "statement_timeout",
                    format!("{}ms", settings.statement_timeout.as_millis()),
                ),
                ("idle_in_transaction_session_timeout", IDLE_IN_TRANSACTION.to_owned()),
                ("jit", "off".to_owned()),
            ])
            .options(extra.iter().copied()),
        // PgBouncer 1.18 also refuses `extra_float_digits` unless told to ignore it; sqlx
        // reads floats in binary, so the server's default does as well. The statements
        // carry their arguments in their text ([`Conn::fetch_rendered`]), so sqlx's own
        // statement lines (a slow one at WARN) would log tenants, keys, accounts and
        // amounts: found from outside under a paused pooler. None are written; the
        // latency histograms show slow calls.
        Pooler::Transaction => options
            .statement_cache_capacity(0)
            .extra_float_digits(None)
            .disable_statement_logging(),
    })
}

/// What the list pool's sessions add to the main pool's start-up options (mode `none`; see
/// [`Db::for_lists`]).
///
/// `plan_cache_mode`: a list's statement takes optional filters and a cursor as parameters
/// (`CASE WHEN $2 IS NULL ...`, `coalesce($3, '-infinity')`), so a custom plan, which folds them
/// away, always looks cheaper to PostgreSQL than the generic plan, and the page was planned
/// again on every call: measured through oncepay at c=1 over 3 million payments, PostgreSQL
/// spent 143 us of CPU a first page and 170 a deep one, 86 and 87 with the generic plan
/// (docs/bench/README.md, "Lists planned once").
///
/// `enable_seqscan`: a generic plan is kept until the table's next ANALYZE, and one made while
/// the statistics said "empty" scans and sorts the whole table (the trap of migrations/V26,
/// here for every page); every list is read through an index (tests/api/list_plans.rs), so
/// no list statement needs a sequential scan.
const LIST_SESSION: [(&str, &str); 2] = [("plan_cache_mode", "force_generic_plan"), ("enable_seqscan", "off")];

/// Connections of the list pool ([`Db::for_lists`]) for a main pool of `main`: a quarter as
/// many, at least one. Pages wait for one of them rather than take a payment's connection.
pub fn list_pool_size(main: u32) -> usize {
    (main as usize / 4).max(1)
}

/// The database as the service uses it: a pool, and how each call runs on it
/// (`ONCEPAY_DB_POOLER`). Every query goes through [`Conn::run`] or [`Conn::transaction`].
///
/// Its `Debug` shows the pool's state and the pooler mode, never the connect options (they
/// hold the database password).
#[derive(Clone)]
pub struct Db {
    pool: Pool,
    session: Arc<Session>,
}

/// The statements that open and close an explicit transaction, for one pooler mode, and how
/// long a call waits for an answer.
#[derive(Clone, Debug)]
struct Session {
    pooler: Pooler,
    /// The longest a call waits for PostgreSQL's answer: the statement timeout plus
    /// [`ANSWER_MARGIN`]; `None` without a statement timeout. PostgreSQL enforces its
    /// statement timeout only on what reaches it, so without this a call on a connection
    /// that went silent would wait until the kernel gave up on the socket (many minutes),
    /// holding its request, its batch and, at shutdown, the process. Past it the call ends
    /// as a broken connection: closed, its outcome unknown ([`DbError::Unknown`]).
    deadline: Option<Duration>,
    /// What the start-up packet carries in mode `none`, as `SET LOCAL`s for a transaction
    /// (empty in mode `none`).
    settings: String,
    begin: String,
    commit: &'static str,
    rollback: &'static str,
}

impl Session {
    fn new(pooler: Pooler, statement_timeout: Duration) -> Self {
        let deadline = (!statement_timeout.is_zero()).then(|| statement_timeout + ANSWER_MARGIN);
        match pooler {
            Pooler::None => Self {
                pooler,
                deadline,
                settings: String::new(),
                begin: "BEGIN".to_owned(),
                commit: "COMMIT",
                rollback: "ROLLBACK",
            },
            // One simple-protocol message each way. sqlx's own type look-ups still prepare
            // named statements (with no statement cache it never closes them), so the
            // transaction deallocates everything before the pooler may hand its server
            // connection to another client; on the way out of a failed transaction only
            // after the ROLLBACK, since an aborted transaction refuses everything else.
            Pooler::Transaction => {
                let settings = format!(
                    "SET LOCAL statement_timeout = '{}ms'; SET LOCAL idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION}'; SET LOCAL jit = off",
                    statement_timeout.as_millis()
                );
                Self {
                    pooler,
                    deadline,
                    begin: format!("BEGIN; {settings}"),
                    settings,
                    commit: "DEALLOCATE ALL; COMMIT",
                    rollback: "ROLLBACK; DEALLOCATE ALL",
                }
            }
        }
    }
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db")
            .field("pool", &self.status())
            .field("pooler", &self.session.pooler)
            .finish_non_exhaustive()
    }
}

impl Db {
    pub fn new(settings: &Settings) -> anyhow::Result<Self> {
        Ok(Self {
            pool: pool(
                connect_options(settings, &[])?,
                settings.db_pool_size as usize,
                settings.db_acquire_timeout,
                pool::closed_counter(),
                settings.db_pooler == Pooler::None,
            ),
            session: Arc::new(Session::new(settings.db_pooler, settings.statement_timeout)),
        })
    }

    /// The pool list pages are read through, beside `main` (whose count of closed
    /// connections it shares): [`list_pool_size`] connections whose sessions plan each
    /// statement once and never scan a table ([`LIST_SESSION`]). A page is one statement
    /// that only reads, so nothing else needs these settings, and nothing else gets them: the
    /// payments' functions and the purge keep PostgreSQL's choice of plan. Behind a
    /// transaction-mode pooler no statement is kept prepared (each is planned with its
    /// values anyway), so the list pool's connections are like the main pool's.
    pub fn for_lists(settings: &Settings, main: &Db) -> anyhow::Result<Self> {
        Ok(Self {
            pool: pool(
                connect_options(settings, &LIST_SESSION)?,
                list_pool_size(settings.db_pool_size),
                settings.db_acquire_timeout,
                main.pool.manager().closed.clone(),
                settings.db_pooler == Pooler::None,
            ),
            session: Arc::clone(&main.session),
        })
    }

    /// A pool like this one (its connect options, session and timeouts) of its own `size`
    /// connections.
    pub fn sibling(&self, size: usize) -> Self {
        Self {
            pool: pool::sibling(&self.pool, size),
            session: Arc::clone(&self.session),
        }
    }

    /// The same pool, whose calls wait for PostgreSQL's answer as long as it takes: for a
    /// batch job that lifts the statement timeout itself (`oncepay audit`).
    pub fn without_deadline(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            session: Arc::new(Session {
                deadline: None,
                ..(*self.session).clone()
            }),
        }
    }

    /// A pool of `size` direct connections made with `options` as they are (tools and
    /// tests): mode `none`, no timeouts added.
    pub fn direct(options: PgConnectOptions, size: usize) -> Self {
        Self {
            pool: pool(options, size, Duration::from_secs(30), pool::closed_counter(), true),
            session: Arc::new(Session::new(Pooler::None, Duration::ZERO)),
        }
    }

    /// A pool of its own (two connections) with the connection options of a sqlx pool: for
    /// tests and tools holding one.
    pub fn beside(pool: &sqlx::PgPool) -> Self {
        Self::direct((*pool.connect_options()).clone(), 2)
    }

    pub fn status(&self) -> PoolStatus {
        let status = self.pool.status();
        PoolStatus {
            size: status.size,
            idle: status.available,
            max: status.max_size,
        }
    }

    /// Closes the idle connections (a clean `Terminate` each) and refuses further calls;
    /// connections in use are closed when their call returns them. The goodbyes get
    /// [`CLOSE_WAIT`]: a TLS connection's close waits for the server's own, which a database
    /// that went silent never sends, and a stopping process must not wait for it (the
    /// sockets are dropped instead, which PostgreSQL sees as a client gone).
    pub async fn close(&self) {
        let idle = self.pool.retain(|_, _| false).removed;
        self.pool.close();
        let goodbyes = futures_util::future::join_all(idle.into_iter().map(Connection::close));
        if tokio::time::timeout(CLOSE_WAIT, goodbyes).await.is_err() {
            tracing::debug!("idle database connections dropped without their goodbye");
        }
    }

    /// `oncepay_db_connections_closed_total{reason}`, for the process's metrics registry.
    pub fn connections_closed(&self) -> &IntCounterVec {
        &self.pool.manager().closed
    }

    /// A pooled connection (see [`acquire`] for the errors).
    pub async fn conn(&self) -> Result<Conn, DbError> {
        Ok(Conn::new(acquire(&self.pool).await?, Arc::clone(&self.session)))
    }

    /// [`Db::conn`] without the pool's warning when no connection can be opened: for the
    /// schema check, whose callers report the failure themselves (once per attempt while
    /// `serve` waits for the database, or as the command's one error line).
    async fn conn_unlogged(&self) -> Result<Conn, DbError> {
        Ok(Conn::new(
            acquire_unlogged(&self.pool).await?,
            Arc::clone(&self.session),
        ))
    }

    /// One call on a connection of its own: see [`Conn::run`].
    pub async fn run<T>(&self, f: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>) -> Result<T, DbError> {
        self.conn().await?.run(f).await
    }

    /// One transaction on a connection of its own: see [`Conn::transaction`].
    pub async fn transaction<T>(
        &self,
        f: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, DbError> {
        self.conn().await?.transaction(f).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_url_is_said_once_and_a_missing_certificate_is_named() {
        assert!(parse_url("postgres://u@127.0.0.1:5432/db?sslmode=require").is_ok());
        let bogus = parse_url("postgres://u@127.0.0.1/db?sslmode=bogus")
            .unwrap_err()
            .to_string();
        assert_eq!(bogus.matches("bogus").count(), 1, "{bogus}");
        let missing = parse_url("postgres://u@127.0.0.1/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem")
            .unwrap_err()
            .to_string();
        assert!(missing.contains("/nonexistent/ca.pem"), "{missing}");
    }

    #[tokio::test]
    async fn debug_shows_no_password_of_the_pool_nor_of_what_holds_it() {
        let settings =
            Settings::from_env_with_database("postgres://oncepay:s3cret-pw@db.example:5432/oncepay".to_owned())
                .unwrap();
        let db = Db::new(&settings).unwrap();
        let schedule = crate::purge::Schedule {
            db: db.clone(),
            retention: crate::purge::Retention {
                keys: Duration::from_secs(1),
                events: Duration::from_secs(1),
            },
            batch: 1,
            every: Duration::from_secs(1),
        };
        for shown in [
            format!("{db:?}"),
            format!("{schedule:?}"),
            format!("{:?}", db.pool.manager()),
        ] {
            assert!(!shown.contains("s3cret"), "{shown}");
            assert!(!shown.contains("db.example"), "{shown}");
        }
        assert!(format!("{db:?}").contains("pooler"), "it still tells something");
    }
}
