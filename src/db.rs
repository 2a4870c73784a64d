//! The PostgreSQL side: connection pool, migrations, schema check, and [`DbError`], the
//! classes of database failure the layers above decide on (the edge maps them to HTTP).

use std::str::FromStr;

use anyhow::Context;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

use crate::config::Settings;

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Application name of the service's connections (visible in `pg_stat_activity`).
pub const APPLICATION_NAME: &str = "oncepay";

/// Advisory lock key serialising `oncepay migrate` runs ("oncepay" in ASCII).
const MIGRATION_LOCK: i64 = 0x006f_6e63_6570_6179;

/// Builds the pool. Connections carry their statement timeout from the start-up packet, so no
/// request pays a round trip for a `SET` (the in-flight wait is set inside each claim, for its
/// transaction only); there is no ping on acquire (a broken connection is closed when its
/// error surfaces, see [`Conn::discard_if_broken`]).
pub fn pool(settings: &Settings) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(&settings.database_url)
        .context("DATABASE_URL is not a valid PostgreSQL URL")?
        .application_name(APPLICATION_NAME)
        .options([
            (
                "statement_timeout",
                format!("{}ms", settings.statement_timeout.as_millis()),
            ),
            ("idle_in_transaction_session_timeout", "60s".to_owned()),
        ]);
    Ok(PgPoolOptions::new()
        .max_connections(settings.db_pool_size)
        .min_connections(0)
        .acquire_timeout(settings.db_acquire_timeout)
        .test_before_acquire(false)
        .connect_lazy_with(options))
}

/// A pooled connection that is closed instead of returned when it failed at the
/// connection level, so the next request does not inherit a dead socket.
pub struct Conn(PoolConnection<Postgres>);

impl Conn {
    pub fn discard_if_broken<T>(&mut self, result: Result<T, sqlx::Error>) -> Result<T, DbError> {
        if let Err(err) = &result {
            if is_connection_broken(err) {
                self.0.close_on_drop();
            }
        }
        result.map_err(DbError::from)
    }
}

impl std::ops::Deref for Conn {
    type Target = sqlx::PgConnection;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
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
pub async fn acquire(pool: &PgPool) -> Result<Conn, DbError> {
    match pool.acquire().await {
        Ok(conn) => Ok(Conn(conn)),
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

fn is_connection_broken(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(_) => sqlstate(err).is_some_and(|c| c.starts_with("08") || c.starts_with("57P")),
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
pub async fn check_schema(pool: &PgPool) -> anyhow::Result<()> {
    let applied: Option<i32> = sqlx::query_scalar("SELECT max(version) FROM refinery_schema_history")
        .fetch_one(pool)
        .await
        .or_else(|err| match sqlstate(&err).as_deref() {
            Some("42P01") => Ok(None), // no history table: never migrated
            _ => Err(err),
        })
        .context("cannot read the schema version from DATABASE_URL")?;
    let expected = expected_schema_version();
    match applied {
        Some(v) if v >= expected => Ok(()),
        applied => anyhow::bail!(
            "the database schema is behind (at version {}, this build needs {expected}): run `oncepay migrate` first",
            applied.map_or_else(|| "none".to_owned(), |v| v.to_string())
        ),
    }
}
