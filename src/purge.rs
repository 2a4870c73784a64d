//! The purge (contract section 5, rule 11): deletes idempotency-key rows older than the
//! retention, in bounded batches of short transactions, safely from several replicas at once.
//!
//! Each batch is one `DELETE` of at most `batch` rows picked through the `created_at` index
//! with `FOR UPDATE SKIP LOCKED`: concurrent purgers take disjoint rows (the sum of their
//! counts is the number deleted), a batch never waits on a payment, and no transaction holds
//! more than one batch of row locks or WAL. Payments, accounts and balances are never
//! touched. Nothing is held across batches, not even a lock: the purge works the same
//! through a transaction-mode pooler (`ONCEPAY_DB_POOLER=transaction`).

use std::time::{Duration, Instant};

use crate::db::{Db, DbError};

/// Advisory lock key taken by the replica running a batch of the in-process schedule ("purge").
const SCHEDULE_LOCK: i64 = 0x0070_7572_6765;

/// How often a long purge reports progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Deletes every key row whose `created_at` is older than `retention`; returns the count.
/// Also purges the webhooks' finished deliveries and their events ([`purge_webhooks`]).
pub async fn purge(db: &Db, retention: Duration, batch: i64) -> Result<u64, DbError> {
    let deleted = purge_batches(db, retention, batch, false).await?.unwrap_or(0);
    purge_webhooks(db, retention, batch).await?;
    Ok(deleted)
}

/// The webhooks' bounded growth: deliveries finished (delivered, given up, cancelled) longer
/// than `retention` ago are deleted with their attempts, then events left with no delivery,
/// and events older than `retention` that no endpoint took when they were fanned out;
/// and a delivery still pending or held for an endpoint deleted meanwhile (written by a
/// fan-out that raced the deletion) is cancelled. (A disabled endpoint's deliveries are held,
/// not cancelled: they are finished, as far as this is concerned, when they were held, and go
/// after the retention like the others.) Batches as for the keys; returns the events deleted.
pub async fn purge_webhooks(db: &Db, retention: Duration, batch: i64) -> Result<u64, DbError> {
    let retention_secs = retention.as_secs_f64();
    db.run(async |c| {
        sqlx::query!(
            r#"UPDATE webhook_deliveries d SET state = 'cancelled', finished_at = now(), leased_until = NULL
                 FROM webhook_endpoints e
                WHERE d.state IN ('pending', 'held') AND e.tenant_id = d.tenant_id AND e.endpoint_id = d.endpoint_id
                  AND e.deleted_at IS NOT NULL"#
        )
        .execute(c)
        .await
    })
    .await?;
    let mut events: u64 = 0;
    loop {
        let (deliveries, deleted_events) = db
            .run(async |c| {
                let r = sqlx::query!(
                    r#"WITH doomed AS (
                           SELECT tenant_id, event_id, endpoint_id FROM webhook_deliveries
                            WHERE finished_at < now() - make_interval(secs => $1)
                            ORDER BY finished_at
                            LIMIT $2
                              FOR UPDATE SKIP LOCKED),
                       attempts AS (
                           DELETE FROM webhook_attempts a USING doomed
                            WHERE a.tenant_id = doomed.tenant_id AND a.event_id = doomed.event_id
                              AND a.endpoint_id = doomed.endpoint_id),
                       deliveries AS (
                           DELETE FROM webhook_deliveries d USING doomed
                            WHERE d.tenant_id = doomed.tenant_id AND d.event_id = doomed.event_id
                              AND d.endpoint_id = doomed.endpoint_id
                           RETURNING d.tenant_id, d.event_id),
                       events AS (
                           DELETE FROM webhook_events e
                            WHERE (e.tenant_id, e.event_id) IN (SELECT tenant_id, event_id FROM deliveries)
                              AND NOT EXISTS (SELECT FROM webhook_deliveries o
                                               WHERE o.tenant_id = e.tenant_id AND o.event_id = e.event_id
                                                 AND (o.tenant_id, o.event_id, o.endpoint_id) NOT IN
                                                     (SELECT tenant_id, event_id, endpoint_id FROM doomed))
                           RETURNING 1)
                   SELECT (SELECT count(*) FROM deliveries) AS "deliveries!",
                          (SELECT count(*) FROM events) AS "events!""#,
                    retention_secs,
                    batch,
                )
                .fetch_one(c)
                .await?;
                Ok((r.deliveries, r.events))
            })
            .await?;
        events += deleted_events as u64;
        if deliveries < batch {
            break;
        }
    }
    // Events that no endpoint took when they were fanned out (every endpoint deleted or
    // disabled between the change and its fan-out: migrations/V14) have no delivery to be
    // purged with; they go by their own age, found by the fan-out's index (V19: its predicate
    // is `awaiting_fan_out IS NOT NULL`, written out so the planner can use it).
    loop {
        let unsent = db
            .run(async |c| {
                let r = sqlx::query!(
                    r#"DELETE FROM webhook_events e
                        USING (SELECT tenant_id, event_id FROM webhook_events
                                WHERE awaiting_fan_out IS NOT NULL AND NOT awaiting_fan_out
                                  AND created_at < now() - make_interval(secs => $1)
                                ORDER BY sequence
                                LIMIT $2
                                  FOR UPDATE SKIP LOCKED) doomed
                        WHERE e.tenant_id = doomed.tenant_id AND e.event_id = doomed.event_id"#,
                    retention_secs,
                    batch,
                )
                .execute(c)
                .await?;
                Ok(r.rows_affected())
            })
            .await?;
        events += unsent;
        if unsent < batch as u64 {
            break;
        }
    }
    if events > 0 {
        tracing::info!(events, "purged delivered webhook events");
    }
    Ok(events)
}

/// Runs batches until a short one; with `scheduled`, each batch first takes the schedule's
/// transaction-scoped advisory lock, and the run stops (`None` if it deleted nothing yet)
/// when another replica holds it.
async fn purge_batches(db: &Db, retention: Duration, batch: i64, scheduled: bool) -> Result<Option<u64>, DbError> {
    let retention_secs = retention.as_secs_f64();
    let started = Instant::now();
    let mut last_report = started;
    let mut deleted: u64 = 0;
    loop {
        let delete = async |c: &mut sqlx::PgConnection| {
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
            .execute(c)
            .await?;
            Ok(result.rows_affected())
        };
        let n = if scheduled {
            // The lock lives as long as the batch's transaction: nothing to release, and
            // nothing left behind on a pooled server connection.
            let n = db
                .transaction(async |c| {
                    let leader: bool =
                        sqlx::query_scalar!(r#"SELECT pg_try_advisory_xact_lock($1) AS "locked!""#, SCHEDULE_LOCK)
                            .fetch_one(&mut *c)
                            .await?;
                    if leader {
                        delete(c).await.map(Some)
                    } else {
                        Ok(None)
                    }
                })
                .await?;
            match n {
                Some(n) => n,
                None if deleted == 0 => return Ok(None),
                None => break,
            }
        } else {
            db.run(delete).await?
        };
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
    Ok(Some(deleted))
}

/// What the in-process schedule needs: the database and two settings.
#[derive(Clone, Debug)]
pub struct Schedule {
    pub db: Db,
    pub retention: Duration,
    pub batch: i64,
    pub every: Duration,
}

/// The opt-in in-process schedule (`ONCEPAY_PURGE_INTERVAL_SECS`): every replica wakes up,
/// and each batch is run by whichever one takes the advisory lock for it, so batches never
/// run twice at once; `on_purged` hears each run's count.
pub async fn schedule(schedule: Schedule, on_purged: impl Fn(u64)) {
    let mut ticker = tokio::time::interval(schedule.every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match purge_batches(&schedule.db, schedule.retention, schedule.batch, true).await {
            Ok(Some(deleted)) => {
                on_purged(deleted);
                if let Err(err) = purge_webhooks(&schedule.db, schedule.retention, schedule.batch).await {
                    tracing::warn!(error = %err, "scheduled purge of webhook events failed; will try again");
                }
            }
            Ok(None) => tracing::debug!("another replica holds the purge lock; skipped"),
            Err(err) => tracing::warn!(error = %err, "scheduled purge failed; will try again"),
        }
    }
}
