//! The completer: on every replica, a loop that finishes the top-ups (and refunds) whose
//! request is gone (a crash, a client that gave up) once they have been left alone for
//! `ONCEPAY_COMPLETER_AFTER_SECS`, and looks again at those that wait at the processor when
//! their next look is due; only those of its own processor (its `ONCEPAY_PROCESSOR_NAME`, or
//! its URL for rows written before migrations/V23: a PaymentIntent lives at one processor).
//! It leases one at a time (`FOR UPDATE SKIP LOCKED`, then the lease: replicas never drive the
//! same one at once, and no lease waits while the completer drives another) and drives each as
//! a resumed request would: it looks at the PaymentIntent first, confirms it only if it was
//! never confirmed, and records the final state.

use std::time::{Duration, Instant};

use uuid::Uuid;

use super::refund::RefundEnd;
use super::{CompleterCounters, Driver, TopUpError, TopUps};
use crate::ledger::top_ups;

/// Top-ups driven per round at most.
const PER_ROUND: usize = 16;

/// A round takes no new top-up after this long (the one under way finishes its drive).
const ROUND_BUDGET: Duration = Duration::from_secs(60);

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

/// One round: leases the due top-ups one by one and drives each; gives how many it drove.
pub async fn run_once(
    top_ups: &TopUps,
    after: Duration,
    counters: &CompleterCounters,
) -> Result<usize, crate::db::DbError> {
    let after_secs = i32::try_from(after.as_secs()).unwrap_or(i32::MAX);
    let lease_secs = top_ups.lease_secs();
    let started = Instant::now();
    let mut driven = 0;
    while driven < PER_ROUND && started.elapsed() < ROUND_BUDGET {
        let owner = Uuid::new_v4();
        let sent = Instant::now();
        let names = &top_ups.finishes;
        let Some(row) = top_ups
            .db
            .run(async |c| top_ups::claim_due(c, owner, after_secs, lease_secs, 1, names).await)
            .await?
            .pop()
        else {
            break;
        };
        driven += 1;
        let id = row.top_up_id;
        let lease = top_ups.lease_from(owner, sent);
        let label = if *row.status == "processing" {
            match top_ups.drive_top_up(row, lease, Driver::Completer).await {
                Ok(row) => {
                    tracing::info!(top_up = %id, status = row.shown_status(), "completer finished a top-up left unfinished");
                    "finished"
                }
                Err(TopUpError::Waiting { .. }) => "waiting",
                Err(_) => "unknown",
            }
        } else {
            match top_ups.drive_refund(row, lease, Driver::Completer).await {
                Ok(RefundEnd::Pending(_)) => "waiting",
                Ok(end) => {
                    // Its end's name, not the row (found from outside: the row's Debug,
                    // ~900 characters with the client's keys and the balance, at INFO).
                    let refund = if matches!(end, RefundEnd::Failed) {
                        "refund_failed"
                    } else {
                        "refunded"
                    };
                    tracing::info!(top_up = %id, refund, "completer finished a refund left unfinished");
                    "finished"
                }
                Err(_) => "unknown",
            }
        };
        counters.operations.with_label_values(&[label]).inc();
    }
    let (unfinished, oldest_secs) = top_ups.db.run(async |c| top_ups::unfinished(c).await).await?;
    counters.unfinished.set(unfinished);
    counters.oldest_unfinished.set(oldest_secs);
    Ok(driven)
}
