//! The schema: the migrations embedded from `migrations/`, and the check `serve` makes that
//! the database is not behind this build.

use anyhow::Context;

use super::error::sqlstate;
use super::{Db, DbError};

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Advisory lock key serialising `oncepay migrate` runs ("oncepay" in ASCII).
const MIGRATION_LOCK: i64 = 0x006f_6e63_6570_6179;

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
