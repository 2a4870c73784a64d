//! Payments that arrive together leave together: one statement, one transaction, one commit
//! for all of them ([`Batcher`]).
//!
//! Why: PostgreSQL's cost of a payment is not only its SQL. Each transaction costs a wake-up
//! of its backend, a round trip, and a commit that waits for its WAL flush, and behind an
//! HTTP server fewer commits share each flush than behind pgbench (docs/bench/analysis.md).
//! Batched, a statement carries up to `ONCEPAY_DB_BATCH_MAX` payments and at most
//! `ONCEPAY_DB_BATCHES_IN_FLIGHT` statements are out per process; while they are, new
//! payments queue and leave in the next one. At low load a payment leaves alone, at once.
//!
//! A payment waits for a slot at most `ONCEPAY_DB_ACQUIRE_TIMEOUT_MS`, as a request waits
//! for a pooled connection, and is then refused (429) without having run; one already in a
//! batch is always answered with what its batch did.
//!
//! What stays as it was, and why:
//! - The key row and the debit still commit in one transaction (the batch's), so the retry
//!   after a lost answer replays; each item is the same `oncepay_pay` call as alone.
//! - A failed statement commits nothing. When the connection broke, every item gets the
//!   same transient failure (the commit may or may not have happened: the client retries
//!   with its key, as after any lost answer). Any other failure (a duplicate that waited
//!   too long for its in-flight original, a deadlock, a timeout) is one item's: each item
//!   then runs again alone and gets its own answer.
//! - A duplicate in a batch waits for its in-flight original at most
//!   [`IN_BATCH_INFLIGHT_WAIT`], not `ONCEPAY_INFLIGHT_WAIT_MS`: meanwhile it holds the
//!   account rows its batch's earlier items locked. Past that the batch splits, and alone it
//!   waits the full time, holding nothing else.
//! - Items run in the order of what they lock (the account), so two batches take their
//!   account rows in one order and cannot deadlock on them; a key claimed twice with
//!   different bodies can still make a cycle, which PostgreSQL breaks (40P01) and the
//!   items then run alone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus::{Histogram, IntCounter};
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::db::{Db, DbError};
use crate::domain::TenantId;
use crate::ledger::{Batched, ClaimArgs, Effect, Outcome};

/// The longest a payment in a batch waits for its key's in-flight original before the batch
/// gives up and splits. An original normally finishes within one batch's time (a few ms).
pub const IN_BATCH_INFLIGHT_WAIT: Duration = Duration::from_millis(200);

/// How batches are formed.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most items in one statement.
    pub max_items: usize,
    /// Statements in flight at once.
    pub in_flight: usize,
    /// Items waiting beyond this many are refused as [`DbError::Saturated`].
    pub queue: usize,
    /// An item still waiting for a slot after this long is refused as [`DbError::Saturated`]
    /// (`ONCEPAY_DB_ACQUIRE_TIMEOUT_MS`, as a request waits for a pooled connection): when
    /// the slots are stuck (a database that stopped answering), clients hear 429 at once
    /// instead of queueing for the statement timeout.
    pub queue_wait: Duration,
}

/// What a batcher counts, registered by the caller.
#[derive(Clone)]
pub struct Counters {
    /// Items per statement.
    pub size: Histogram,
    /// Batches that failed as a whole and whose items ran again alone.
    pub split: IntCounter,
}

type Reply<E> = oneshot::Sender<Result<Outcome<<E as Effect>::Row>, DbError>>;

struct Job<E: Batched> {
    tenant: TenantId,
    claim: ClaimArgs,
    effect: E,
    reply: Reply<E>,
    /// Set by whichever comes first: the dispatcher taking the item into a batch, or its
    /// waiter giving up after [`Limits::queue_wait`]. An item is never both run and refused.
    taken: Arc<AtomicBool>,
}

/// Runs effects of one kind in batches (see the module's documentation).
pub struct Batcher<E: Batched> {
    queue: mpsc::Sender<Job<E>>,
    queue_wait: Duration,
}

impl<E: Batched> Batcher<E> {
    /// Starts the batcher's dispatcher on the current tokio runtime; it stops when the
    /// batcher is dropped and the queued items have left.
    pub fn start(db: Db, limits: Limits, counters: Counters) -> Self {
        let (queue, jobs) = mpsc::channel(limits.queue.max(1));
        tokio::spawn(dispatch(db, jobs, limits, counters));
        Self {
            queue,
            queue_wait: limits.queue_wait,
        }
    }

    /// Runs `effect` (in a batch when others are waiting) and gives its outcome.
    pub async fn run(&self, tenant: TenantId, claim: ClaimArgs, effect: E) -> Result<Outcome<E::Row>, DbError> {
        let (reply, mut answer) = oneshot::channel();
        let taken = Arc::new(AtomicBool::new(false));
        let job = Job {
            tenant,
            claim,
            effect,
            reply,
            taken: Arc::clone(&taken),
        };
        self.queue.try_send(job).map_err(|err| match err {
            mpsc::error::TrySendError::Full(_) => DbError::Saturated,
            mpsc::error::TrySendError::Closed(_) => DbError::Transient(sqlx::Error::PoolClosed),
        })?;
        // The sender is dropped unanswered only if the batch's task died (a panic).
        let crashed = || Err(DbError::Transient(sqlx::Error::WorkerCrashed));
        match tokio::time::timeout(self.queue_wait, &mut answer).await {
            Ok(result) => result.unwrap_or_else(|_| crashed()),
            // Still queued: refused, and the dispatcher will skip it. Already in a batch: it
            // runs, so its answer is awaited (a refusal now could hide a commit).
            Err(_) if !taken.swap(true, Ordering::AcqRel) => Err(DbError::Saturated),
            Err(_) => answer.await.unwrap_or_else(|_| crashed()),
        }
    }
}

/// Waits for a free slot, then takes every waiting item (up to the limit) into one batch.
async fn dispatch<E: Batched>(db: Db, mut jobs: mpsc::Receiver<Job<E>>, limits: Limits, counters: Counters) {
    let slots = Arc::new(Semaphore::new(limits.in_flight.max(1)));
    loop {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let mut batch = Vec::with_capacity(limits.max_items);
        if jobs.recv_many(&mut batch, limits.max_items.max(1)).await == 0 {
            return; // every sender is gone
        }
        // Those whose waiter gave up were answered 429 and must not run.
        batch.retain(|job| !job.taken.swap(true, Ordering::AcqRel));
        if batch.is_empty() {
            continue;
        }
        let (db, counters) = (db.clone(), counters.clone());
        tokio::spawn(async move {
            execute(&db, batch, &counters).await;
            drop(slot);
        });
    }
}

async fn execute<E: Batched>(db: &Db, mut batch: Vec<Job<E>>, counters: &Counters) {
    counters.size.observe(batch.len() as f64);
    if batch.len() == 1 {
        let job = batch.pop().expect("one job");
        let result = alone(db, &job).await;
        let _ = job.reply.send(result);
        return;
    }
    batch.sort_by(|a, b| (a.effect.lock_order(), a.claim.key()).cmp(&(b.effect.lock_order(), b.claim.key())));
    let mut conn = match db.conn().await {
        Ok(conn) => conn,
        Err(err) => return answer_all(batch, &err),
    };
    let waits: Vec<i32> = batch
        .iter_mut()
        .map(|j| j.claim.cap_inflight_wait(IN_BATCH_INFLIGHT_WAIT))
        .collect();
    let items: Vec<_> = batch.iter().map(|j| (j.tenant, &j.claim, &j.effect)).collect();
    let result = conn.run(async |c| E::run_batch(c, &items).await).await;
    drop(items);
    match result {
        Ok(outcomes) => {
            for (job, outcome) in batch.into_iter().zip(outcomes) {
                let _ = job.reply.send(Ok(outcome));
            }
        }
        Err(err) if conn.is_broken() => answer_all(batch, &err),
        Err(err) => {
            // Nothing was committed: each item runs again alone, with its full wait, and
            // gets its own answer.
            drop(conn);
            for (job, wait) in batch.iter_mut().zip(waits) {
                job.claim.restore_inflight_wait(wait);
            }
            counters.split.inc();
            tracing::info!(error = %err, items = batch.len(), "a batch failed as a whole; its items run alone");
            futures_util::future::join_all(batch.into_iter().map(async |job| {
                let result = alone(db, &job).await;
                let _ = job.reply.send(result);
            }))
            .await;
        }
    }
}

/// One item in a statement of its own, as without batching.
async fn alone<E: Batched>(db: &Db, job: &Job<E>) -> Result<Outcome<E::Row>, DbError> {
    db.run(async |c| job.effect.run(c, job.tenant, &job.claim).await).await
}

/// The same failure for every item of a batch that could not run, or whose connection broke.
fn answer_all<E: Batched>(batch: Vec<Job<E>>, err: &DbError) {
    for job in batch {
        let copy = match err {
            DbError::InProgress => DbError::InProgress,
            DbError::Saturated => DbError::Saturated,
            DbError::Transient(e) => DbError::Transient(sqlx::Error::Protocol(e.to_string())),
            DbError::Other(e) => DbError::Other(sqlx::Error::Decode(e.to_string().into())),
        };
        let _ = job.reply.send(Err(copy));
    }
}
