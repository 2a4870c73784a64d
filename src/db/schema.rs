//! The schema: the migrations embedded from `migrations/`, and the check `serve` makes that
//! the database is not behind this build.

use std::str::FromStr;

use anyhow::Context;
use refinery::{AsyncMigrate, Migration};
use refinery_core::traits::r#async::{AsyncQuery, AsyncTransaction};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, Executor, PgConnection, Row};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use super::error::sqlstate;
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
    let options = PgConnectOptions::from_str(database_url).context("DATABASE_URL is not a valid PostgreSQL URL")?;
    let conn = PgConnection::connect_with(&options)
        .await
        .map_err(|err| anyhow::anyhow!("cannot connect to DATABASE_URL: {err}"))?;
    let mut migrator = Migrator(conn);
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut migrator.0)
        .await?;
    let report = embedded::migrations::runner().run_async(&mut migrator).await;
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut migrator.0)
        .await?;
    migrator.0.close().await?;
    Ok(report.context("migration failed")?.applied_migrations().len())
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
        // One line, whatever the cause (a certificate that does not verify, a refused
        // connection): the sqlx error says what went wrong.
        Err(DbError::Transient(err) | DbError::Unknown(err)) => {
            anyhow::bail!("cannot reach the database at DATABASE_URL: {err}")
        }
        Err(err) => anyhow::bail!("cannot read the schema version from DATABASE_URL: {err}"),
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
