//! The purge (docs/operations.md, "The purge"): deletes idempotency-key rows older than the
//! retention and past their replay window, and webhook events older than their retention, in
//! bounded batches of short transactions, safely from several replicas at once.
//!
//! Each batch is one `DELETE` of at most `batch` rows picked through the `created_at` index
//! with `FOR UPDATE SKIP LOCKED`: concurrent purgers take disjoint rows (the sum of their
//! counts is the number deleted), a batch never waits on a payment, and no transaction holds
//! more than one batch of row locks or WAL. Payments, accounts and balances are never
//! touched. Nothing is held across batches, not even a lock: the purge works the same
//! through a transaction-mode pooler (`ONCEPAY_DB_POOLER=transaction`).

use std::time::{Duration, Instant};

use crate::config::Settings;
use crate::db::{Db, DbError};

/// Advisory lock key taken by the replica running a batch of the in-process schedule ("purge").
const SCHEDULE_LOCK: i64 = 0x0070_7572_6765;

/// How often a long purge reports progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// A long run's progress: when it started, and whether a progress line is due.
struct Progress {
    started: Instant,
    last_report: Instant,
}

impl Progress {
    fn new() -> Self {
        let now = Instant::now();
        Self {
            started: now,
            last_report: now,
        }
    }

    /// The rows a second so far, when [`PROGRESS_EVERY`] has passed since the last line.
    fn due(&mut self, rows: u64) -> Option<f64> {
        if self.last_report.elapsed() < PROGRESS_EVERY {
            return None;
        }
        self.last_report = Instant::now();
        Some((rows as f64 / self.started.elapsed().as_secs_f64()).round())
    }
}

/// How often a running server renews the declaration of its key retention ([`declaring`]).
const DECLARE_EVERY: Duration = Duration::from_secs(3_600);
/// How far ahead a declaration holds: past the next renewal, so that a server that runs on
/// is never without one.
const DECLARED_FOR: Duration = Duration::from_secs(2 * 3_600);
/// How soon a declaration that failed (the database away) is tried again.
const DECLARE_RETRY: Duration = Duration::from_secs(60);

/// How long the purge keeps what it deletes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// Key rows, by their `created_at` (`ONCEPAY_RETENTION_SECS`).
    pub keys: Duration,
    /// Events, delivered or not, with their deliveries and attempts
    /// (`ONCEPAY_EVENT_RETENTION_DAYS`).
    pub events: Duration,
}

impl Retention {
    pub fn of(settings: &Settings) -> Self {
        Self {
            keys: settings.retention,
            events: settings.event_retention,
        }
    }
}

/// The longest one run of the events' purge goes on; the next run takes up what is left (the
/// first run after a long pause, or on a table that grew faster than it is purged, would
/// otherwise hold a replica's purge for as long as the backlog lasts).
const EVENTS_RUN_LIMIT: Duration = Duration::from_secs(15 * 60);

/// Records that the keys this server makes are kept `retention` (`oncepay_key_retention`,
/// migrations/V32), for every purger of the database, until [`DECLARED_FOR`] from now.
pub async fn declare_retention(db: &Db, retention: Duration) -> Result<(), DbError> {
    let retention_secs = i64::try_from(retention.as_secs()).unwrap_or(i64::MAX);
    let ahead = DECLARED_FOR.as_secs_f64();
    db.run(async |c| {
        sqlx::query!(
            r#"WITH gone AS (
                   -- Retentions whose servers' last keys have all outlived them.
                   DELETE FROM oncepay_key_retention r
                    WHERE r.declared_until + make_interval(secs => r.retention_secs) < now()
                      AND r.retention_secs <> $1)
               INSERT INTO oncepay_key_retention AS r (retention_secs, declared_until)
               VALUES ($1, now() + make_interval(secs => $2))
               ON CONFLICT (retention_secs)
               DO UPDATE SET declared_until = greatest(r.declared_until, excluded.declared_until)"#,
            retention_secs,
            ahead,
        )
        .execute(c)
        .await
    })
    .await?;
    Ok(())
}

/// A server's declaration of its key retention, renewed every [`DECLARE_EVERY`] for as long
/// as it runs (each renewal carries it [`DECLARED_FOR`] ahead).
pub async fn declaring(db: Db, retention: Duration) {
    loop {
        let wait = match declare_retention(&db, retention).await {
            Ok(()) => DECLARE_EVERY,
            Err(err) => {
                tracing::warn!(error = %err, "the key retention could not be declared; will try again");
                DECLARE_RETRY
            }
        };
        tokio::time::sleep(wait).await;
    }
}

/// The retention a purge keeps keys for: the longest of `own` and of every server's still in
/// force (one whose server may have made a key younger than it: [`declare_retention`]).
/// Logged when it is longer than `own`: the purger was started with a shorter retention than
/// a server of this database keeps keys for.
pub async fn key_retention(db: &Db, own: Duration) -> Result<Duration, DbError> {
    let declared = declared_retention(db).await?.unwrap_or_default();
    if declared > own {
        tracing::warn!(
            own_secs = own.as_secs(),
            kept_secs = declared.as_secs(),
            "this purge's ONCEPAY_RETENTION_SECS is shorter than a server of this database keeps keys for: \
             keys are purged at the longer one, so that none past its replay window is processed again"
        );
    }
    Ok(own.max(declared))
}

/// The retention `oncepay audit` expects key rows for: `own`, or the servers' declared one
/// when it is shorter (logged). No purge deletes a key younger than the declared one, but a
/// purge at it deletes older keys, whatever the auditing host's own setting: an audit run
/// without the servers' ONCEPAY_RETENTION_SECS called every payment past it "BROKEN" (a soak:
/// 182,350 on a sound database).
pub async fn audited_retention(db: &Db, own: Duration) -> Result<Duration, DbError> {
    Ok(match declared_retention(db).await? {
        Some(declared) if declared < own => {
            tracing::info!(
                own_secs = own.as_secs(),
                declared_secs = declared.as_secs(),
                "the servers keep keys for less than this ONCEPAY_RETENTION_SECS: the audit expects key rows for the servers' retention"
            );
            declared
        }
        _ => own,
    })
}

/// The longest key retention a server of this database declared that is still in force
/// ([`declare_retention`]); `None` when none is. Every purge keeps keys at least this long.
pub async fn declared_retention(db: &Db) -> Result<Option<Duration>, DbError> {
    let declared: Option<i64> = db
        .run(async |c| {
            sqlx::query_scalar!(
                r#"SELECT max(r.retention_secs) FROM oncepay_key_retention r
                    WHERE r.declared_until + make_interval(secs => r.retention_secs) > now()"#
            )
            .fetch_one(c)
            .await
        })
        .await?;
    Ok(declared.map(|secs| Duration::from_secs(secs.max(0).unsigned_abs())))
}

/// Deletes every key row whose `created_at` is older than the key retention ([`key_retention`]:
/// `retention.keys`, or a server's longer one) and whose replay
/// window has ended (`expires_at`, as the server that made it set it: a purger started with
/// a shorter retention than the servers' window must not delete a key a retry may still
/// replay, or the retry would charge again). Also purges the webhooks' events past
/// `retention.events` ([`purge_webhooks`]); returns both counts.
pub async fn purge(db: &Db, retention: Retention, batch: i64) -> Result<Purged, DbError> {
    let keys = purge_batches(db, retention.keys, batch, false).await?.unwrap_or(0);
    let events = purge_webhooks(db, retention.events, batch).await?;
    purge_deleted_endpoints(db, retention, batch).await?;
    Ok(Purged { keys, events })
}

/// What a [`purge`] deleted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Purged {
    /// Key rows past the key retention.
    pub keys: u64,
    /// Webhook events past theirs (with their deliveries and attempts).
    pub events: u64,
}

/// Deletes the rows of webhook endpoints deleted longer ago than both retentions (a tenant
/// may create and delete endpoints without end: found from outside, 3,425 deleted rows of
/// 3,428 after 20 s of churn, kept for ever). By then their events, deliveries and attempts
/// have gone with the events' purge, and the keys that created or deleted them with the
/// keys' (a replay rebuilds its answer from the row); one whose tenant still has an event
/// from before its deletion (a purge behind) waits for a later run. Batches as for the keys;
/// returns the endpoints deleted.
pub async fn purge_deleted_endpoints(db: &Db, retention: Retention, batch: i64) -> Result<u64, DbError> {
    let older_than = retention.keys.max(retention.events).as_secs_f64();
    let mut purged = 0;
    loop {
        let deleted = db
            .run(async |c| {
                let r = sqlx::query!(
                    r#"DELETE FROM webhook_endpoints e
                        WHERE e.ctid = ANY (ARRAY(
                                  SELECT o.ctid FROM webhook_endpoints o
                                   WHERE o.deleted_at < now() - make_interval(secs => $1)
                                     AND NOT EXISTS (SELECT FROM webhook_events ev
                                                      WHERE ev.tenant_id = o.tenant_id
                                                        AND ev.created_at < o.deleted_at + interval '1 hour')
                                   LIMIT $2
                                     FOR UPDATE SKIP LOCKED))"#,
                    older_than,
                    batch,
                )
                .execute(c)
                .await?;
                Ok(r.rows_affected())
            })
            .await?;
        purged += deleted;
        if deleted < batch.unsigned_abs() {
            break;
        }
    }
    if purged > 0 {
        tracing::info!(
            endpoints = purged,
            "purged webhook endpoints deleted past both retentions"
        );
    }
    Ok(purged)
}

/// The webhooks' bounded growth (docs/operations.md, "The purge"): events older than `retention` are
/// deleted, delivered or not, with their deliveries and their attempts, which are kept exactly
/// as long (the attempts list and `recover` read them). The events are found through their
/// list index, tenant by tenant (migrations/V24: no index of their own for the purge, which
/// would cost every event's insert an entry). A delivery still pending or held when its event
/// goes (an endpoint disabled for the whole retention, or failing past it) goes with it: it is
/// counted and logged, never sent. A delivery still pending or held for an endpoint deleted
/// meanwhile (written by a fan-out that raced the deletion) is cancelled first. Recoveries, and
/// the progress of those never finished, go after the same retention. Batches as for the keys;
/// returns the events deleted.
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
    let mut progress = Progress::new();
    let (mut events, mut undelivered): (u64, u64) = (0, 0);
    loop {
        let (deleted, dropped) = db
            .run(async |c| {
                let r = sqlx::query!(
                    r#"WITH doomed AS (
                           SELECT old.tenant_id, old.event_id
                             FROM tenants t
                            CROSS JOIN LATERAL (
                                  SELECT ev.tenant_id, ev.event_id FROM webhook_events ev
                                   WHERE ev.tenant_id = t.tenant_id
                                     AND ev.created_at < now() - make_interval(secs => $1)
                                   ORDER BY ev.created_at
                                   LIMIT $2
                                     FOR UPDATE SKIP LOCKED) AS old
                            LIMIT $2),
                       attempts AS (
                           DELETE FROM webhook_attempts a USING doomed
                            WHERE a.tenant_id = doomed.tenant_id AND a.event_id = doomed.event_id),
                       deliveries AS (
                           DELETE FROM webhook_deliveries d USING doomed
                            WHERE d.tenant_id = doomed.tenant_id AND d.event_id = doomed.event_id
                           RETURNING d.state),
                       events AS (
                           DELETE FROM webhook_events e USING doomed
                            WHERE e.tenant_id = doomed.tenant_id AND e.event_id = doomed.event_id
                           RETURNING 1)
                   SELECT (SELECT count(*) FROM events) AS "events!",
                          (SELECT count(*) FROM deliveries WHERE state IN ('pending', 'held')) AS "undelivered!""#,
                    retention_secs,
                    batch,
                )
                .fetch_one(c)
                .await?;
                Ok((r.events, r.undelivered))
            })
            .await?;
        events += deleted as u64;
        undelivered += dropped as u64;
        if let Some(rate) = progress.due(events) {
            tracing::info!(events, events_per_sec = rate, "purge of webhook events in progress");
        }
        // A short batch means nothing older is left that another purger is not already on.
        if deleted < batch {
            break;
        }
        if progress.started.elapsed() >= EVENTS_RUN_LIMIT {
            tracing::warn!(
                events,
                "the events' purge stopped after its run limit; the next run goes on"
            );
            break;
        }
    }
    loop {
        let recoveries = db
            .run(async |c| {
                let r = sqlx::query!(
                    r#"DELETE FROM webhook_recoveries r
                        WHERE r.ctid = ANY (ARRAY(SELECT o.ctid FROM webhook_recoveries o
                                                   WHERE o.created_at < now() - make_interval(secs => $1)
                                                   ORDER BY o.created_at
                                                   LIMIT $2
                                                     FOR UPDATE SKIP LOCKED))"#,
                    retention_secs,
                    batch,
                )
                .execute(c)
                .await?;
                Ok(r.rows_affected())
            })
            .await?;
        if recoveries < batch as u64 || progress.started.elapsed() >= EVENTS_RUN_LIMIT {
            break;
        }
    }
    // A keyed recovery's progress that no keyed transaction took (its request never came
    // back; migrations/V51): after the recoveries' retention, one row a request.
    db.run(async |c| {
        sqlx::query!(
            "DELETE FROM webhook_recovery_progress WHERE updated_at < now() - make_interval(secs => $1)",
            retention_secs
        )
        .execute(c)
        .await
    })
    .await?;
    if undelivered > 0 {
        tracing::warn!(
            undelivered,
            "webhook deliveries never made (held for a disabled endpoint, or still failing) were purged with their events, past ONCEPAY_EVENT_RETENTION_DAYS"
        );
    }
    if events > 0 {
        tracing::info!(events, "purged webhook events past their retention");
    }
    Ok(events)
}

/// Runs batches until a short one; with `scheduled`, each batch first takes the schedule's
/// transaction-scoped advisory lock, and the run stops (`None` if it deleted nothing yet)
/// when another replica holds it.
async fn purge_batches(db: &Db, retention: Duration, batch: i64, scheduled: bool) -> Result<Option<u64>, DbError> {
    let retention_secs = key_retention(db, retention).await?.as_secs_f64();
    let mut progress = Progress::new();
    let mut deleted: u64 = 0;
    loop {
        let delete = async |c: &mut sqlx::PgConnection| {
            let result = sqlx::query!(
                r#"DELETE FROM idempotency_keys k
                   USING (SELECT tenant_id, key FROM idempotency_keys
                           WHERE created_at < now() - make_interval(secs => $1)
                             AND expires_at <= now()
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
        if let Some(rate) = progress.due(deleted) {
            tracing::info!(deleted, rows_per_sec = rate, "purge in progress");
        }
        // A short batch means nothing older is left that another purger is not already on.
        if n < batch as u64 {
            break;
        }
    }
    tracing::info!(
        deleted,
        seconds = progress.started.elapsed().as_secs_f64(),
        "purge finished"
    );
    Ok(Some(deleted))
}

/// What the in-process schedule needs: the database and its settings.
#[derive(Clone, Debug)]
pub struct Schedule {
    pub db: Db,
    pub retention: Retention,
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
        match purge_batches(&schedule.db, schedule.retention.keys, schedule.batch, true).await {
            Ok(Some(deleted)) => {
                on_purged(deleted);
                if let Err(err) = purge_webhooks(&schedule.db, schedule.retention.events, schedule.batch).await {
                    tracing::warn!(error = %err, "scheduled purge of webhook events failed; will try again");
                } else if let Err(err) = purge_deleted_endpoints(&schedule.db, schedule.retention, schedule.batch).await
                {
                    tracing::warn!(error = %err, "scheduled purge of deleted webhook endpoints failed; will try again");
                }
            }
            Ok(None) => tracing::debug!("another replica holds the purge lock; skipped"),
            Err(err) => tracing::warn!(error = %err, "scheduled purge failed; will try again"),
        }
    }
}
