//! The PostgreSQL side: connection pool, migrations, schema check, and [`DbError`], the
//! classes of database failure the layers above decide on (the edge maps them to HTTP).

use std::str::FromStr;
use std::sync::Arc;

use anyhow::Context;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor, PgConnection, PgPool, Postgres};

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

/// Builds the pool for `settings.db_pooler`.
///
/// `none`: connections carry their statement timeout from the start-up packet, so no
/// request pays a round trip for a `SET`, and sqlx keeps each statement prepared (named)
/// per connection: one round trip per call.
///
/// `transaction`: a transaction-mode pooler refuses start-up options and hands each
/// transaction to any server connection, so the start-up packet carries nothing but the
/// application name, and no statement is cached: the settings travel in each call's
/// `BEGIN` instead (see [`Conn::run`]).
///
/// Either way there is no ping on acquire (a broken connection is closed when its error
/// surfaces).
pub fn pool(settings: &Settings) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(&settings.database_url)
        .context("DATABASE_URL is not a valid PostgreSQL URL")?
        .application_name(APPLICATION_NAME);
    let options = match settings.db_pooler {
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
    };
    Ok(PgPoolOptions::new()
        .max_connections(settings.db_pool_size)
        .min_connections(0)
        .acquire_timeout(settings.db_acquire_timeout)
        .test_before_acquire(false)
        .connect_lazy_with(options))
}

/// The database as the service uses it: a pool, and how each call runs on it
/// (`ONCEPAY_DB_POOLER`). Every query goes through [`Conn::run`] or [`Conn::transaction`].
#[derive(Clone, Debug)]
pub struct Db {
    pool: PgPool,
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
    fn new(pooler: Pooler, statement_timeout: std::time::Duration) -> Self {
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
            pool: pool(settings)?,
            session: Arc::new(Session::new(settings.db_pooler, settings.statement_timeout)),
        })
    }

    /// The pool underneath, for its statistics and for closing it.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// A pooled connection (see [`acquire`] for the errors).
    pub async fn conn(&self) -> Result<Conn, DbError> {
        Ok(Conn {
            conn: acquire(&self.pool).await?,
            session: Arc::clone(&self.session),
            open: false,
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

/// A pool of direct connections (tools and tests): mode `none`.
impl From<&PgPool> for Db {
    fn from(pool: &PgPool) -> Self {
        Self {
            pool: pool.clone(),
            session: Arc::new(Session::new(Pooler::None, std::time::Duration::ZERO)),
        }
    }
}

impl From<&Db> for Db {
    fn from(db: &Db) -> Self {
        db.clone()
    }
}

/// A pooled connection, used only through [`Conn::run`] and [`Conn::transaction`], so that
/// each call is correct for the pooler in front of PostgreSQL. It is closed instead of
/// returned when it failed at the connection level (the next request must not inherit a
/// dead socket) or when it was dropped inside a transaction (a cancelled request).
pub struct Conn {
    conn: PoolConnection<Postgres>,
    session: Arc<Session>,
    /// An explicit transaction may be open on it.
    open: bool,
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
                let result = f(&mut self.conn).await;
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
        self.open = true;
        let mut result = match self.conn.execute(session.begin.as_str()).await {
            Ok(_) => f(&mut self.conn).await,
            Err(err) => Err(err),
        };
        if result.is_ok() {
            match self.conn.execute(session.commit).await {
                Ok(_) => self.open = false,
                Err(err) => result = Err(err),
            }
        }
        if let Err(err) = &result {
            // Also after a refused commit: the ROLLBACK is then a no-op that still
            // deallocates. A connection whose transaction did not end is closed (`Drop`).
            if !is_connection_broken(err) && self.conn.execute(session.rollback).await.is_ok() {
                self.open = false;
            }
        }
        self.discard_if_broken(result)
    }

    /// Closes the connection instead of returning it to the pool (it reached a node that
    /// cannot take writes: behind a proxy, a new connection reaches the current primary).
    pub fn discard(&mut self) {
        self.conn.close_on_drop();
    }

    fn discard_if_broken<T>(&mut self, result: Result<T, sqlx::Error>) -> Result<T, DbError> {
        if let Err(err) = &result {
            if is_connection_broken(err) {
                self.conn.close_on_drop();
            }
        }
        result.map_err(DbError::from)
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.open {
            self.conn.close_on_drop();
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
pub async fn acquire(pool: &PgPool) -> Result<PoolConnection<Postgres>, DbError> {
    match pool.acquire().await {
        Ok(conn) => Ok(conn),
        Err(sqlx::Error::PoolTimedOut) if pool.size() as usize > pool.num_idle() => Err(DbError::Saturated),
        Err(err) => {
            tracing::warn!(error = %err, "no database connection");
            Err(DbError::Transient(err))
        }
    }
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
