//! The PostgreSQL side: connection pool, migrations, schema check, and [`DbError`], the
//! classes of database failure the layers above decide on (the edge maps them to HTTP).

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use deadpool::managed::{Manager, Metrics, Object, PoolError, RecycleResult, TimeoutType};
use prometheus::{IntCounterVec, Opts};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, Executor, PgConnection};

use crate::config::{Pooler, Settings};

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Application name of the service's connections (visible in `pg_stat_activity`).
pub const APPLICATION_NAME: &str = "oncepay";

/// Advisory lock key serialising `oncepay migrate` runs ("oncepay" in ASCII).
const MIGRATION_LOCK: i64 = 0x006f_6e63_6570_6179;

/// How long a transaction may sit idle (a stalled process must not hold row locks).
const IDLE_IN_TRANSACTION: &str = "60s";

/// The connection options for `settings.db_pooler`.
///
/// `none`: connections carry their statement timeout from the start-up packet, so no
/// request pays a round trip for a `SET`, and sqlx keeps each statement prepared (named)
/// per connection: one round trip per call.
///
/// `transaction`: a transaction-mode pooler refuses start-up options and hands each
/// transaction to any server connection, so the start-up packet carries nothing but the
/// application name, and no statement is cached: the settings travel in each call's
/// `BEGIN` instead (see [`Conn::run`]).
fn connect_options(settings: &Settings) -> anyhow::Result<PgConnectOptions> {
    let options = PgConnectOptions::from_str(&settings.database_url)
        .context("DATABASE_URL is not a valid PostgreSQL URL")?
        .application_name(APPLICATION_NAME);
    Ok(match settings.db_pooler {
        Pooler::None => options.options([
            (
                "statement_timeout",
                format!("{}ms", settings.statement_timeout.as_millis()),
            ),
            ("idle_in_transaction_session_timeout", IDLE_IN_TRANSACTION.to_owned()),
        ]),
        // PgBouncer 1.18 also refuses `extra_float_digits` unless told to ignore it; sqlx
        // reads floats in binary, so the server's default does as well.
        Pooler::Transaction => options.statement_cache_capacity(0).extra_float_digits(None),
    })
}

/// A connection that sat unused this long is pinged before it is handed out: it may have
/// been cut while idle (a failover, a pooler restart). One used more recently answered its
/// last call, so it is handed out as it is.
const IDLE_BEFORE_PING: Duration = Duration::from_secs(1);

/// Opens and hands out the pool's connections (deadpool's [`Manager`]).
///
/// Why not sqlx's own pool: it sends a `Sync` and waits for the answer every time a
/// connection goes back to the pool (`ping` on release, sqlx-core 0.8 and 0.9), so each
/// request cost PostgreSQL a second wake-up and the server a second round trip: measured
/// with `make bench-ab`, new payments ran 1.23x faster without it (docs/bench/analysis.md).
/// Here a connection is checked only when it leaves the pool after [`IDLE_BEFORE_PING`];
/// one whose call failed at the connection level, or that was dropped in the middle of a
/// call or a transaction, is closed instead of returned ([`Conn`]).
#[derive(Debug)]
struct Connector {
    options: PgConnectOptions,
    closed: IntCounterVec,
}

impl Manager for Connector {
    type Type = PgConnection;
    type Error = sqlx::Error;

    async fn create(&self) -> Result<PgConnection, sqlx::Error> {
        PgConnection::connect_with(&self.options).await
    }

    async fn recycle(&self, conn: &mut PgConnection, metrics: &Metrics) -> RecycleResult<sqlx::Error> {
        if metrics.last_used() >= IDLE_BEFORE_PING {
            if let Err(err) = conn.ping().await {
                self.closed.with_label_values(&["dead_idle"]).inc();
                return Err(err.into());
            }
        }
        Ok(())
    }
}

type Pool = deadpool::managed::Pool<Connector>;

/// A pool of at most `size` connections, opened when first needed; a caller waits at most
/// `acquire_timeout` for one (also for opening it).
fn pool(options: PgConnectOptions, size: usize, acquire_timeout: Duration) -> Pool {
    let closed = IntCounterVec::new(
        Opts::new(
            "oncepay_db_connections_closed_total",
            "Pooled connections closed instead of reused: broken (a connection-level failure or a \
             read-only node), abandoned (a call or transaction cancelled midway), dead_idle (failed \
             the ping after sitting idle)",
        ),
        &["reason"],
    )
    .expect("valid metric");
    Pool::builder(Connector { options, closed })
        .max_size(size)
        .wait_timeout(Some(acquire_timeout))
        .create_timeout(Some(acquire_timeout))
        .recycle_timeout(Some(acquire_timeout))
        .runtime(deadpool::Runtime::Tokio1)
        .build()
        .expect("a runtime is set, so the timeouts are valid")
}

/// What the pool holds now: connections open, of which idle, and the most it may open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStatus {
    pub size: usize,
    pub idle: usize,
    pub max: usize,
}

/// The database as the service uses it: a pool, and how each call runs on it
/// (`ONCEPAY_DB_POOLER`). Every query goes through [`Conn::run`] or [`Conn::transaction`].
#[derive(Clone, Debug)]
pub struct Db {
    pool: Pool,
    session: Arc<Session>,
}

/// The statements that open and close an explicit transaction, for one pooler mode.
#[derive(Debug)]
struct Session {
    pooler: Pooler,
    begin: String,
    commit: &'static str,
    rollback: &'static str,
}

impl Session {
    fn new(pooler: Pooler, statement_timeout: Duration) -> Self {
        match pooler {
            Pooler::None => Self {
                pooler,
                begin: "BEGIN".to_owned(),
                commit: "COMMIT",
                rollback: "ROLLBACK",
            },
            // One simple-protocol message each way. sqlx's own type look-ups still prepare
            // named statements (with no statement cache it never closes them), so the
            // transaction deallocates everything before the pooler may hand its server
            // connection to another client; on the way out of a failed transaction only
            // after the ROLLBACK, since an aborted transaction refuses everything else.
            Pooler::Transaction => Self {
                pooler,
                begin: format!(
                    "BEGIN; SET LOCAL statement_timeout = '{}ms'; SET LOCAL idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION}'",
                    statement_timeout.as_millis()
                ),
                commit: "DEALLOCATE ALL; COMMIT",
                rollback: "ROLLBACK; DEALLOCATE ALL",
            },
        }
    }
}

impl Db {
    pub fn new(settings: &Settings) -> anyhow::Result<Self> {
        Ok(Self {
            pool: pool(
                connect_options(settings)?,
                settings.db_pool_size as usize,
                settings.db_acquire_timeout,
            ),
            session: Arc::new(Session::new(settings.db_pooler, settings.statement_timeout)),
        })
    }

    /// A pool of `size` direct connections made with `options` as they are (tools and
    /// tests): mode `none`, no timeouts added.
    pub fn direct(options: PgConnectOptions, size: usize) -> Self {
        Self {
            pool: pool(options, size, Duration::from_secs(30)),
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
    /// connections in use are closed when their call returns them.
    pub async fn close(&self) {
        let idle = self.pool.retain(|_, _| false).removed;
        self.pool.close();
        futures_util::future::join_all(idle.into_iter().map(Connection::close)).await;
    }

    /// `oncepay_db_connections_closed_total{reason}`, for the process's metrics registry.
    pub fn connections_closed(&self) -> &IntCounterVec {
        &self.pool.manager().closed
    }

    /// A pooled connection (see [`acquire`] for the errors).
    pub async fn conn(&self) -> Result<Conn, DbError> {
        Ok(Conn {
            conn: Some(acquire(&self.pool).await?),
            session: Arc::clone(&self.session),
            unsettled: false,
            broken: false,
        })
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

/// A pooled connection, used only through [`Conn::run`] and [`Conn::transaction`], so that
/// each call is correct for the pooler in front of PostgreSQL. It is closed instead of
/// returned when it failed at the connection level (the next request must not inherit a
/// dead socket), or when it was dropped in the middle of a call or a transaction (a
/// cancelled request: its protocol state or an open transaction must not reach the next).
pub struct Conn {
    /// `None` only once dropped.
    conn: Option<Object<Connector>>,
    session: Arc<Session>,
    /// A call or an explicit transaction started on it and has not ended cleanly.
    unsettled: bool,
    /// It must be closed, not returned.
    broken: bool,
}

impl Conn {
    /// Runs `f`, which makes one database call (one statement: the SQL functions apply a
    /// whole operation in one), so that it is correct in either pooler mode:
    ///
    /// - `none`: `f` runs as is, autocommit: one round trip with a cached statement.
    /// - `transaction`: `f` runs inside [`Conn::transaction`]. sqlx sends Parse/Describe
    ///   and Bind/Execute with a Sync between them (sqlx issue #67); only an open
    ///   transaction keeps the pooler from giving the second half to another server
    ///   connection, and its `BEGIN` carries the statement timeout (`SET LOCAL`) that the
    ///   start-up packet cannot.
    pub async fn run<T>(
        &mut self,
        f: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, DbError> {
        match self.session.pooler {
            Pooler::None => {
                self.unsettled = true;
                let result = f(self.raw()).await;
                self.unsettled = false;
                self.discard_if_broken(result)
            }
            Pooler::Transaction => self.transaction(f).await,
        }
    }

    /// Runs `f` in one explicit transaction, committed when `f` succeeds and rolled back
    /// when it fails; `f` must not begin one itself.
    pub async fn transaction<T>(
        &mut self,
        f: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, DbError> {
        let session = Arc::clone(&self.session);
        self.unsettled = true;
        let conn = self.raw();
        let mut result = match conn.execute(session.begin.as_str()).await {
            Ok(_) => f(&mut *conn).await,
            Err(err) => Err(err),
        };
        let mut ended = false;
        if result.is_ok() {
            match conn.execute(session.commit).await {
                Ok(_) => ended = true,
                Err(err) => result = Err(err),
            }
        }
        if let Err(err) = &result {
            // Also after a refused commit: the ROLLBACK is then a no-op that still
            // deallocates. A connection whose transaction did not end is closed (`Drop`).
            ended = !is_connection_broken(err) && conn.execute(session.rollback).await.is_ok();
        }
        self.unsettled = !ended;
        self.discard_if_broken(result)
    }

    /// Closes the connection instead of returning it to the pool (it reached a node that
    /// cannot take writes: behind a proxy, a new connection reaches the current primary).
    pub fn discard(&mut self) {
        self.broken = true;
    }

    /// Whether it failed at the connection level (it will be closed, not returned).
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    fn raw(&mut self) -> &mut PgConnection {
        self.conn.as_mut().expect("a Conn holds its connection until dropped")
    }

    fn discard_if_broken<T>(&mut self, result: Result<T, sqlx::Error>) -> Result<T, DbError> {
        if let Err(err) = &result {
            if is_connection_broken(err) {
                self.broken = true;
            }
        }
        result.map_err(DbError::from)
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.unsettled || self.broken {
            if let Some(conn) = self.conn.take() {
                let reason = if self.broken { "broken" } else { "abandoned" };
                if let Some(pool) = Object::pool(&conn) {
                    pool.manager().closed.with_label_values(&[reason]).inc();
                }
                // Out of the pool; dropping it closes the socket, and PostgreSQL rolls back
                // whatever was open.
                drop(Object::take(conn));
            }
        }
    }
}

/// A database failure, classified for the layers above.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// SQLSTATE 55P03: a duplicate waited `ONCEPAY_INFLIGHT_WAIT_MS` for the key's original
    /// transaction, which is still running.
    #[error("the key's original request is still in flight")]
    InProgress,
    /// Every pooled connection is busy: the process is at capacity.
    #[error("every database connection is busy")]
    Saturated,
    /// The same request may succeed later: nothing was committed, or (the connection broke
    /// during the commit) it was and a retry with the same key replays it.
    #[error("transient database failure: {0}")]
    Transient(#[source] sqlx::Error),
    /// Anything else: a bug or a broken invariant.
    #[error(transparent)]
    Other(sqlx::Error),
}

impl From<sqlx::Error> for DbError {
    fn from(err: sqlx::Error) -> Self {
        if is_in_progress(&err) {
            Self::InProgress
        } else if is_transient(&err) {
            Self::Transient(err)
        } else {
            Self::Other(err)
        }
    }
}

/// Takes a connection from the pool: [`DbError::Saturated`] when every connection stayed
/// busy, [`DbError::Transient`] when none can be opened (database down).
async fn acquire(pool: &Pool) -> Result<Object<Connector>, DbError> {
    let err = match pool.get().await {
        Ok(conn) => return Ok(conn),
        // Waiting for a permit: every connection is checked out.
        Err(PoolError::Timeout(TimeoutType::Wait)) => return Err(DbError::Saturated),
        Err(PoolError::Backend(err)) => err,
        Err(PoolError::Closed) => sqlx::Error::PoolClosed,
        Err(PoolError::Timeout(_)) => sqlx::Error::PoolTimedOut,
        Err(PoolError::NoRuntimeSpecified | PoolError::PostCreateHook(_)) => {
            unreachable!("the pool has a runtime and no hooks")
        }
    };
    tracing::warn!(error = %err, "no database connection");
    Err(DbError::Transient(err))
}

fn sqlstate(err: &sqlx::Error) -> Option<String> {
    match err {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// SQLSTATE 55P03: the key's original transaction outlived `lock_timeout`.
fn is_in_progress(err: &sqlx::Error) -> bool {
    sqlstate(err).as_deref() == Some("55P03")
}

/// Connection-level failures, after which the connection is closed rather than reused. 25006
/// (read_only_sql_transaction) counts: the connection reached a node that became a standby
/// (a failover behind a proxy), and only a new connection reaches the new primary.
fn is_connection_broken(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(_) => {
            sqlstate(err).is_some_and(|c| c.starts_with("08") || c.starts_with("57P") || c == "25006")
        }
        _ => false,
    }
}

/// Failures after which the same request may succeed later. Nothing was committed, except
/// when the connection broke during the commit itself: then a retry with the key replays it.
fn is_transient(err: &sqlx::Error) -> bool {
    if is_connection_broken(err) {
        return true;
    }
    match err {
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(_) => sqlstate(err).is_some_and(|c| {
            matches!(c.as_str(), "40001" | "40P01" | "57014" | "55P03" | "55006") || c.starts_with("53")
            // insufficient resources
        }),
        _ => false,
    }
}

/// Applies the embedded migrations. An advisory lock makes concurrent runs wait for each
/// other instead of racing on `refinery_schema_history`.
pub async fn migrate(database_url: &str) -> anyhow::Result<usize> {
    let (mut client, connection) = tokio_postgres::connect(database_url, tokio_postgres::NoTls)
        .await
        .context("cannot connect to DATABASE_URL")?;
    let driver = tokio::spawn(connection);
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    let report = embedded::migrations::runner().run_async(&mut client).await;
    client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
        .await?;
    drop(client);
    let _ = driver.await;
    Ok(report.context("migration failed")?.applied_migrations().len())
}

/// The newest migration version embedded in this binary.
pub fn expected_schema_version() -> i32 {
    embedded::migrations::runner()
        .get_migrations()
        .iter()
        .map(|m| m.version() as i32)
        .max()
        .unwrap_or(0)
}

/// How many migrations this binary embeds.
pub fn embedded_migration_count() -> usize {
    embedded::migrations::runner().get_migrations().len()
}

/// Fails with a one-line message naming `oncepay migrate` if the schema is behind.
pub async fn check_schema(db: &Db) -> anyhow::Result<()> {
    let read = db
        .run(async |c| {
            sqlx::query_scalar("SELECT max(version) FROM refinery_schema_history")
                .fetch_one(c)
                .await
        })
        .await;
    let applied: Option<i32> = match read {
        Ok(version) => version,
        Err(DbError::Other(err)) if sqlstate(&err).as_deref() == Some("42P01") => None, // never migrated
        Err(err) => return Err(anyhow::Error::new(err).context("cannot read the schema version from DATABASE_URL")),
    };
    let expected = expected_schema_version();
    match applied {
        Some(v) if v >= expected => Ok(()),
        applied => anyhow::bail!(
            "the database schema is behind (at version {}, this build needs {expected}): run `oncepay migrate` first",
            applied.map_or_else(|| "none".to_owned(), |v| v.to_string())
        ),
    }
}
