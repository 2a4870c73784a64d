//! The purge (contract section 5, rule 11): deletes idempotency-key rows older than the
//! retention, in bounded batches of short transactions, safely from several replicas at once.
//!
//! Each batch is one autocommit `DELETE` of at most `batch` rows picked through the
//! `created_at` index with `FOR UPDATE SKIP LOCKED`: concurrent purgers take disjoint rows
//! (the sum of their counts is the number deleted), a batch never waits on a payment, and
//! no transaction holds more than one batch of row locks or WAL. Payments, accounts and
//! balances are never touched.

use std::time::{Duration, Instant};

use sqlx::PgPool;

/// Advisory lock key held by the one replica running the in-process schedule ("purge").
const SCHEDULE_LOCK: i64 = 0x0070_7572_6765;

/// How often a long purge reports progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Deletes every key row whose `created_at` is older than `retention`; returns the count.
pub async fn purge(pool: &PgPool, retention: Duration, batch: i64) -> Result<u64, sqlx::Error> {
    let retention_secs = retention.as_secs_f64();
    let started = Instant::now();
    let mut last_report = started;
    let mut deleted: u64 = 0;
    loop {
        let result = sqlx::query!(
            r#"DELETE FROM idempotency_keys k
               USING (SELECT tenant_id, key FROM idempotency_keys
                       WHERE created_at < now() - make_interval(secs => $1)
                       ORDER BY created_at
                       LIMIT $2
                       FOR UPDATE SKIP LOCKED) doomed
               WHERE k.tenant_id = doomed.tenant_id AND k.key = doomed.key"#,
            retention_secs,
            batch,
        )
        .execute(pool)
        .await?;
        let n = result.rows_affected();
        deleted += n;
        if last_report.elapsed() >= PROGRESS_EVERY {
            last_report = Instant::now();
            let rate = deleted as f64 / started.elapsed().as_secs_f64();
            tracing::info!(deleted, rows_per_sec = rate.round(), "purge in progress");
        }
        // A short batch means nothing older is left that another purger is not already on.
        if n < batch as u64 {
            break;
        }
    }
    tracing::info!(deleted, seconds = started.elapsed().as_secs_f64(), "purge finished");
    Ok(deleted)
}

/// What the in-process schedule needs: the pool and two settings.
#[derive(Clone, Debug)]
pub struct Schedule {
    pub pool: PgPool,
    pub retention: Duration,
    pub batch: i64,
    pub every: Duration,
}

/// The opt-in in-process schedule (`ONCEPAY_PURGE_INTERVAL_SECS`): every replica wakes up,
/// only the one holding the advisory lock purges; `on_purged` hears each run's count.
pub async fn schedule(schedule: Schedule, on_purged: impl Fn(u64)) {
    let mut ticker = tokio::time::interval(schedule.every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match run_if_leader(&schedule).await {
            Ok(Some(deleted)) => on_purged(deleted),
            Ok(None) => tracing::debug!("another replica holds the purge lock; skipped"),
            Err(err) => tracing::warn!(error = %err, "scheduled purge failed; will try again"),
        }
    }
}

async fn run_if_leader(schedule: &Schedule) -> Result<Option<u64>, sqlx::Error> {
    let mut lock_conn = schedule.pool.acquire().await?;
    let leader: bool = sqlx::query_scalar!(r#"SELECT pg_try_advisory_lock($1) AS "locked!""#, SCHEDULE_LOCK)
        .fetch_one(&mut *lock_conn)
        .await?;
    if !leader {
        return Ok(None);
    }
    let result = purge(&schedule.pool, schedule.retention, schedule.batch).await;
    let unlocked = sqlx::query_scalar!("SELECT pg_advisory_unlock($1)", SCHEDULE_LOCK)
        .fetch_one(&mut *lock_conn)
        .await;
    if unlocked.is_err() {
        // The session lock dies with the connection; don't return it to the pool holding it.
        lock_conn.close_on_drop();
    }
    result.map(Some)
}
