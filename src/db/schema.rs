//! The schema: the migrations embedded from `migrations/`, and the check `serve` makes that
//! the database is not behind this build (retried until the database answers:
//! [`wait_for_schema`]).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use backon::{ExponentialBuilder, Retryable};
use refinery::{AsyncMigrate, Migration};
use refinery_core::traits::r#async::{AsyncQuery, AsyncTransaction};
use sqlx::{Connection, Executor, PgConnection, Row};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use super::error::{is_tls_refusal, sqlstate};
use super::{Db, DbError};

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Advisory lock key serialising `oncepay migrate` runs ("oncepay" in ASCII).
const MIGRATION_LOCK: i64 = 0x006f_6e63_6570_6179;

/// Applies the embedded migrations. An advisory lock makes concurrent runs wait for each
/// other instead of racing on `refinery_schema_history`. The connection is sqlx's, like every
/// other of the service's, so `DATABASE_URL`'s `sslmode` and `sslrootcert` hold here too.
pub async fn migrate(database_url: &str) -> anyhow::Result<usize> {
    let options = super::parse_url(database_url)?;
    let conn = PgConnection::connect_with(&options)
        .await
        .map_err(|err| anyhow::anyhow!("cannot connect to DATABASE_URL: {err}"))?;
    let mut migrator = Migrator(conn);
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut migrator.0)
        .await?;
    let report = match ahead_of_this_build(&mut migrator.0).await {
        Ok(None) => embedded::migrations::runner()
            .run_async(&mut migrator)
            .await
            .map(|report| report.applied_migrations().len())
            .context("migration failed"),
        Ok(Some(at)) => {
            tracing::info!(
                schema = at,
                build = expected_schema_version(),
                "the schema is ahead of this build, which finds every one of its migrations applied: nothing to apply"
            );
            Ok(0)
        }
        Err(err) => Err(err),
    };
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut migrator.0)
        .await?;
    migrator.0.close().await?;
    report
}

/// The schema's version, if a later build has migrated it past this one's newest migration
/// and every migration of this build is applied as this build has it; `Err` if the schema is
/// ahead but one of them is not. During a rollout (docs/operations.md) a replica of the
/// previous version restarts on the expanded schema, and a start-up that runs `oncepay migrate`
/// before `serve` must not stop it there: refinery refuses a history with versions it does not
/// know ("missing from the filesystem").
async fn ahead_of_this_build(conn: &mut PgConnection) -> anyhow::Result<Option<i32>> {
    let applied: Vec<(i32, String)> = match sqlx::query_as("SELECT version, checksum FROM refinery_schema_history")
        .fetch_all(&mut *conn)
        .await
    {
        Ok(rows) => rows,
        Err(err) if sqlstate(&err).as_deref() == Some("42P01") => return Ok(None), // never migrated
        Err(err) => return Err(err).context("cannot read refinery_schema_history"),
    };
    let at = applied.iter().map(|(version, _)| *version).max();
    let build = expected_schema_version();
    let Some(at) = at.filter(|at| *at > build) else {
        return Ok(None);
    };
    for migration in embedded::migrations::runner().get_migrations() {
        let version = migration.version() as i32;
        match applied.iter().find(|(v, _)| *v == version) {
            Some((_, checksum)) if *checksum == migration.checksum().to_string() => {}
            found => anyhow::bail!(
                "the schema is at version {at}, ahead of this build ({build}), but this build's migration V{version} {}: \
                 the database and this build diverge",
                if found.is_some() { "was applied with other contents" } else { "was never applied" }
            ),
        }
    }
    Ok(Some(at))
}

/// refinery's driver over a sqlx connection (refinery's own PostgreSQL drivers bring a
/// second client library and its own TLS set-up): each call one transaction, as refinery's
/// tokio-postgres driver does.
struct Migrator(PgConnection);

#[async_trait::async_trait]
impl AsyncTransaction for Migrator {
    type Error = sqlx::Error;

    async fn execute(&mut self, queries: &[&str]) -> Result<usize, sqlx::Error> {
        let conn = &mut self.0;
        conn.execute("BEGIN").await?;
        for query in queries {
            // A string without arguments goes by the simple protocol: a file of many statements.
            if let Err(err) = conn.execute(*query).await {
                let _ = conn.execute("ROLLBACK").await;
                return Err(err);
            }
        }
        conn.execute("COMMIT").await?;
        Ok(queries.len())
    }
}

#[async_trait::async_trait]
impl AsyncQuery<Vec<Migration>> for Migrator {
    async fn query(&mut self, query: &str) -> Result<Vec<Migration>, sqlx::Error> {
        let rows = sqlx::query(query).fetch_all(&mut self.0).await?;
        rows.iter()
            .map(|row| {
                let applied_on: String = row.try_get(2)?;
                let checksum: String = row.try_get(3)?;
                let bad = |what: &str| sqlx::Error::Decode(format!("refinery_schema_history: a bad {what}").into());
                Ok(Migration::applied(
                    row.try_get(0)?,
                    row.try_get(1)?,
                    OffsetDateTime::parse(&applied_on, &Rfc3339).map_err(|_| bad("applied_on"))?,
                    checksum.parse().map_err(|_| bad("checksum"))?,
                ))
            })
            .collect()
    }
}

impl AsyncMigrate for Migrator {}

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

/// Why the schema could not be checked, or what was wrong with it. Each is one line: the
/// cause is in the text, not a `source` that `{:#}` would print a second time.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    /// No connection, or none that answered: the database is down or starting up, out of
    /// connections, refusing the login (a wrong password, PgBouncer's `server_login_retry`).
    #[error("cannot reach the database at DATABASE_URL: {0}")]
    Unreachable(Arc<sqlx::Error>),
    /// The TLS handshake failed or could not start: a certificate that does not verify, or
    /// `sslmode` asking for TLS that the server does not offer.
    #[error("cannot reach the database at DATABASE_URL: {0}")]
    TlsRefused(Arc<sqlx::Error>),
    /// The database answered, with an error (a missing grant, say).
    #[error("cannot read the schema version from DATABASE_URL: {0}")]
    Unreadable(DbError),
    /// Migrations this build needs have not run.
    #[error(
        "the database schema is behind (at version {}, this build needs {expected}): run `oncepay migrate` first",
        .applied.map_or_else(|| "none".to_owned(), |v| v.to_string())
    )]
    Behind { applied: Option<i32>, expected: i32 },
}

impl SchemaError {
    /// Whether waiting may help, with nothing changed in this process: everything but a
    /// schema behind (only `oncepay migrate` mends it) and a TLS refusal (this process's own
    /// `sslmode` and `sslrootcert`). A refused password is retried: it is mended on the
    /// database's side (`ALTER ROLE`, a rotated secret that reaches the database after the
    /// replica started, a pooler's auth file reloaded).
    pub fn is_retried(&self) -> bool {
        matches!(self, Self::Unreachable(_) | Self::Unreadable(_))
    }
}

/// Fails with a one-line message naming `oncepay migrate` if the schema is behind.
pub async fn check_schema(db: &Db) -> Result<(), SchemaError> {
    let read = match db.conn_unlogged().await {
        Ok(mut conn) => {
            conn.run(async |c| {
                sqlx::query_scalar("SELECT max(version) FROM refinery_schema_history")
                    .fetch_one(c)
                    .await
            })
            .await
        }
        Err(err) => Err(err),
    };
    let applied: Option<i32> = match read {
        Ok(version) => version,
        Err(DbError::Other(err)) if sqlstate(&err).as_deref() == Some("42P01") => None, // never migrated
        Err(DbError::Transient(err) | DbError::Unknown(err)) if is_tls_refusal(&err) => {
            return Err(SchemaError::TlsRefused(err))
        }
        Err(DbError::Transient(err) | DbError::Unknown(err)) => return Err(SchemaError::Unreachable(err)),
        Err(DbError::Saturated) => return Err(SchemaError::Unreachable(Arc::new(sqlx::Error::PoolTimedOut))),
        Err(err) => return Err(SchemaError::Unreadable(err)),
    };
    let expected = expected_schema_version();
    match applied {
        Some(v) if v >= expected => Ok(()),
        applied => Err(SchemaError::Behind { applied, expected }),
    }
}

/// The wait before the first retry of [`wait_for_schema`]; each next one is twice as long,
/// up to [`RETRY_WAIT_CAP`].
const FIRST_RETRY_WAIT: Duration = Duration::from_millis(100);

/// The longest wait between two attempts of [`wait_for_schema`], before the jitter, which
/// adds up to as much again: at most 5 s between attempts, so that a database that comes
/// back is in use within seconds, and one attempt every few seconds costs it nothing.
const RETRY_WAIT_CAP: Duration = Duration::from_millis(2_500);

/// [`check_schema`] until it passes, for as long as it takes, with exponential backoff and
/// jitter (replicas restarted together do not knock on a recovering database in step); every
/// failed attempt logged once, at warn. Returns only once the schema passed, or with an error
/// that no wait mends ([`SchemaError::is_retried`]).
pub async fn wait_for_schema(db: &Db) -> Result<(), SchemaError> {
    let attempts = AtomicU32::new(0);
    let backoff = ExponentialBuilder::new()
        .with_min_delay(FIRST_RETRY_WAIT)
        .with_max_delay(RETRY_WAIT_CAP)
        .with_jitter()
        .without_max_times();
    (|| {
        attempts.fetch_add(1, Ordering::Relaxed);
        check_schema(db)
    })
    .retry(backoff)
    .sleep(tokio::time::sleep)
    .when(SchemaError::is_retried)
    .notify(|err, wait| {
        tracing::warn!(
            attempt = attempts.load(Ordering::Relaxed),
            retry_in_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            error = %err,
            "the database is not ready; serving 503 until it is"
        );
    })
    .await?;
    tracing::info!(
        attempts = attempts.load(Ordering::Relaxed),
        "database reached, schema checked: ready"
    );
    Ok(())
}
