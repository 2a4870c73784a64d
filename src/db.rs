//! The PostgreSQL side: connection pool, migrations, schema check and error classes.

use std::str::FromStr;

use anyhow::Context;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

use crate::config::Settings;
use crate::error::ApiError;

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Application name of the service's connections (visible in `pg_stat_activity`).
pub const APPLICATION_NAME: &str = "oncepay";

/// Advisory lock key serialising `oncepay migrate` runs ("oncepay" in ASCII).
const MIGRATION_LOCK: i64 = 0x006f_6e63_6570_6179;

/// Builds the pool. Connections carry their timeouts from the start-up packet, so no request
/// pays a round trip for a `SET`; there is no ping on acquire (a broken connection is closed
/// when its error surfaces, see [`Conn::discard_if_broken`]).
pub fn pool(settings: &Settings) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(&settings.database_url)
        .context("DATABASE_URL is not a valid PostgreSQL URL")?
        .application_name(APPLICATION_NAME)
        .options([
            // Bounds a duplicate's wait on an in-flight key (SQLSTATE 55P03 => 409).
            ("lock_timeout", format!("{}ms", settings.inflight_wait.as_millis())),
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
    pub fn discard_if_broken<T>(&mut self, result: Result<T, sqlx::Error>) -> Result<T, sqlx::Error> {
        if let Err(err) = &result {
            if is_connection_broken(err) {
                self.0.close_on_drop();
            }
        }
        result
    }

    /// Closes the connection instead of returning it to the pool (it reached a node that
    /// cannot take writes: behind a proxy, a new connection reaches the current primary).
    pub fn discard(&mut self) {
        self.0.close_on_drop();
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

/// Before a stored result is answered again (a replay), makes sure the commit that stored
/// it is on the synchronous standbys. A commit waits for them before it becomes visible,
/// unless its wait is cut short (its session terminated, a cancel): then it is visible on
/// this primary alone, and a failover would take it away after the client was told it
/// happened. This writes a WAL record in a transaction of its own, whose commit waits for the
/// standbys to have everything up to it, the replayed key row included (no standby: it waits
/// like any commit, and the client's retry comes back later). Without synchronous
/// replication it costs one small WAL record.
pub async fn await_replicated(conn: &mut Conn) -> Result<(), sqlx::Error> {
    let result = sqlx::query("SELECT pg_logical_emit_message(true, 'oncepay', 'replay')")
        .execute(&mut **conn)
        .await;
    conn.discard_if_broken(result).map(drop)
}

/// Takes a connection from the pool. A full pool answers 429 `overloaded`; a pool that
/// cannot open any connection (database down) answers 503.
pub async fn acquire(pool: &PgPool) -> Result<Conn, ApiError> {
    match pool.acquire().await {
        Ok(conn) => Ok(Conn(conn)),
        Err(sqlx::Error::PoolTimedOut) if pool.size() as usize > pool.num_idle() => Err(ApiError::Overloaded),
        Err(err) => {
            tracing::warn!(error = %err, "no database connection");
            Err(ApiError::Unavailable)
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
pub fn is_in_progress(err: &sqlx::Error) -> bool {
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
pub fn is_transient(err: &sqlx::Error) -> bool {
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
