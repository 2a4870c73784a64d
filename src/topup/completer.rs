//! The completer: on every replica, a loop that finishes the top-ups (and refunds) whose
//! request is gone (a crash, a client that gave up) once they have been left alone for
//! `ONCEPAY_COMPLETER_AFTER_SECS`, of its own processor (a top-up made with another one is
//! that one's business: its PaymentIntent lives there). It leases a few at a time (`FOR UPDATE SKIP LOCKED`, then
//! the lease: replicas never drive the same one at once) and drives each as a resumed
//! request would: it looks at the PaymentIntent first, confirms it only if it was never
//! confirmed, and records the final state.

use std::time::Duration;

use uuid::Uuid;

use super::{CompleterCounters, TopUps};
use crate::ledger::top_ups;

/// Top-ups leased per round.
const BATCH: i32 = 16;

/// Runs until the task is aborted.
pub async fn run(top_ups: TopUps, after: Duration, counters: CompleterCounters) {
    // Often enough that a stale top-up waits little more than `after`; at least every 5 s.
    let every = (after / 4).clamp(Duration::from_millis(200), Duration::from_secs(5));
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let outcome = match run_once(&top_ups, after, &counters).await {
            Ok(_) => "ok",
            Err(err) => {
                tracing::warn!(error = %err, "completer run failed");
                "error"
            }
        };
        counters.runs.with_label_values(&[outcome]).inc();
    }
}

/// One round: leases the stale top-ups and drives each; gives how many it drove.
pub async fn run_once(
    top_ups: &TopUps,
    after: Duration,
    counters: &CompleterCounters,
) -> Result<usize, crate::db::DbError> {
    let owner = Uuid::new_v4();
    let after_secs = i32::try_from(after.as_secs()).unwrap_or(i32::MAX);
    let lease_secs = top_ups.lease_secs();
    let stale = top_ups
        .db
        .run(async |c| top_ups::claim_stale(c, owner, after_secs, lease_secs, BATCH, top_ups.processor()).await)
        .await?;
    let driven = stale.len();
    for row in stale {
        let id = row.top_up_id;
        let result = if *row.status == "processing" {
            top_ups.drive_top_up(row, owner, true).await
        } else {
            top_ups.drive_refund(row, owner, true).await
        };
        let label = match &result {
            Ok(row) => {
                tracing::info!(top_up = %id, status = %*row.status, "completer finished a top-up left unfinished");
                "finished"
            }
            Err(_) => "unknown",
        };
        counters.operations.with_label_values(&[label]).inc();
    }
    let unfinished = top_ups.db.run(async |c| top_ups::unfinished(c).await).await?;
    counters.unfinished.set(unfinished);
    Ok(driven)
}
