//! Payments that arrive together leave together: one statement, one transaction, one commit
//! for all of them ([`Batcher`]).
//!
//! Why: PostgreSQL's cost of a payment is not only its SQL. Each transaction costs a wake-up
//! of its backend, a round trip, and a commit that waits for its WAL flush, and behind an
//! HTTP server fewer commits share each flush than behind pgbench (docs/bench/analysis.md).
//! Batched, a statement carries up to `ONCEPAY_DB_BATCH_MAX` payments and at most
//! [`limit::Limit`] statements are out per process: a number the batcher chooses from the
//! statements' latency (raised while the database has room and payments wait, lowered when
//! latency grows), or `ONCEPAY_DB_BATCHES_IN_FLIGHT` when set; while they are out, new
//! payments queue and leave in the next one. At low load a payment leaves alone, at once.
//!
//! A payment waits for a slot at most `ONCEPAY_DB_ACQUIRE_TIMEOUT_MS`, as a request waits
//! for a pooled connection, and is then refused (429) without having run (titled `Account
//! busy` when a payment of its account was still out, whether or not the dispatcher had read
//! it); one held back as a duplicate of a payment still running (below) waits as a duplicate
//! does, up to `ONCEPAY_INFLIGHT_WAIT_MS`, then answers 409 `request_in_progress`. One
//! already in a batch is always answered with what its batch did.
//!
//! The rules that keep the promise, and why:
//! - **The key row and the debit commit in one transaction** (the batch's), so the retry
//!   after a lost answer replays; each item is the same `oncepay_pay` call as alone.
//! - **Nothing that may have committed runs again.** A batch splits (its items run again
//!   one by one, each with its own answer) only when PostgreSQL answered the statement with
//!   an error that proves the rollback *and* belongs to an item: a duplicate that waited too
//!   long for its original, a deadlock, a data error ([`DbError::is_one_items`]). After a
//!   broken connection, or rows that could not be read, the outcome is unknown: every item
//!   answers 503 and the log says "outcome unknown"; a keyed retry replays whatever
//!   committed. After a statement timeout or an out-of-resources error every item answers
//!   503 at once: 32 statements instead of one would feed the overload.
//! - **One lock order everywhere**: the items of a batch run in the order of (tenant,
//!   account) compared as bytes, the order `oncepay_transfer` takes its two rows in
//!   (`COLLATE "C"`, migrations/V6), so no two batches, nor a batch and a transfer, can wait
//!   on each other's rows in a cycle, whatever the database's collation.
//! - **Tenants kept apart in a process**: an item whose account or key is in a statement
//!   still out is held back in the dispatcher, not sent to wait on the row lock in another
//!   statement, so a hot account or a client's duplicate occupies one slot, never all of
//!   them, and never delays the items of other accounts batched with it. (Across replicas
//!   the row lock still orders them; a duplicate of a key in flight on another replica
//!   waits at most [`IN_BATCH_INFLIGHT_WAIT`] before its batch splits.)
//! - **A tenant's share**: while more than one tenant has payments in the batcher (or had,
//!   within [`ACTIVE_WINDOW`]), no tenant has more than [`Limits::tenant_share`] of its
//!   payments in statements at once; its others wait their turn, in order. On two shared
//!   cores the server, PostgreSQL and the clients compete for CPU, so one tenant paying as
//!   fast as it can would otherwise set the latency of everyone else (docs/bench/README.md,
//!   "Noisy neighbour"). A tenant alone uses every slot and the whole batch.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use prometheus::{Gauge, Histogram, IntCounter, IntCounterVec, IntGauge};
use tokio::sync::{mpsc, oneshot};

use crate::config::Pooler;
use crate::db::{Conn, Db, DbError};
use crate::domain::TenantId;
use crate::ledger::{Batched, ClaimArgs, Effect, Outcome};

mod fill;
pub mod limit;

use fill::Fill;
use limit::{Change, Limit, Sample};

/// The longest a payment in a batch waits for its key's in-flight original (on another
/// replica: one in this process is held back instead) before the batch gives up and splits.
/// An original normally finishes within one batch's time (a few ms).
pub const IN_BATCH_INFLIGHT_WAIT: Duration = Duration::from_millis(200);

/// A tenant whose payments reached the batcher this recently counts as active: a client
/// paying in a closed loop has nothing queued between its answer and its next request, and
/// the others' share must not swing back to everything in that gap.
pub const ACTIVE_WINDOW: Duration = Duration::from_millis(100);

/// How batches are formed.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most items in one statement.
    pub max_items: usize,
    /// Statements in flight at once: `Some(n)`, always n (`ONCEPAY_DB_BATCHES_IN_FLIGHT`);
    /// `None`, chosen by [`Limit`] between 1 and `ceiling`, from `initial`.
    pub in_flight: Option<usize>,
    pub initial: usize,
    pub ceiling: usize,
    /// Items waiting beyond this many are refused as [`DbError::Saturated`].
    pub queue: usize,
    /// An item still waiting for a slot after this long is refused as [`DbError::Saturated`]
    /// (`ONCEPAY_DB_ACQUIRE_TIMEOUT_MS`, as a request waits for a pooled connection): when
    /// the slots are stuck (a database that stopped answering), clients hear 429 at once
    /// instead of queueing for the statement timeout.
    pub queue_wait: Duration,
    /// Most payments of one tenant in statements at once while other tenants are active
    /// (`ONCEPAY_DB_TENANT_SHARE`); 0: no share, a tenant may take every slot.
    pub tenant_share: usize,
}

/// What a batcher counts, registered by the caller.
#[derive(Clone)]
pub struct Counters {
    /// Items per committed statement.
    pub size: Histogram,
    /// Batches that failed as a whole and whose items ran again alone.
    pub split: IntCounter,
    /// Batches that failed as a whole, by what their items were answered:
    /// `split` (ran again one by one), `unknown` (the outcome is unknown: 503, nothing run
    /// again), `refused` (PostgreSQL refused the statement for its own state, a timeout or
    /// an overload: 503 at once).
    pub failed: IntCounterVec,
    /// Items held back because their account or key was in a statement still out.
    pub held_back: IntCounter,
    /// Items held back because their tenant had its share in statements while others were
    /// active.
    pub held_for_share: IntCounter,
    /// `oncepay_db_batches_in_flight_limit`: statements that may be in flight now.
    pub limit: IntGauge,
    /// `oncepay_db_batches_in_flight_limit_changes_total{direction}`: `up`, `down`.
    pub limit_changes: IntCounterVec,
    /// `oncepay_db_batch_least_latency_seconds`: the least latency seen for a statement of
    /// one payment, the baseline the limit is judged against.
    pub least_latency: Gauge,
}

type Reply<E> = oneshot::Sender<Result<Outcome<<E as Effect>::Row>, DbError>>;

/// What an item's statement locks or claims, besides rows no other item touches: its
/// account row and its key (`None` for a keyless payment).
#[derive(Clone, Debug)]
struct Holds {
    account: (TenantId, String),
    key: Option<(TenantId, String)>,
}

struct Job<E: Batched> {
    tenant: TenantId,
    claim: ClaimArgs,
    effect: E,
    reply: Reply<E>,
    /// Set by whichever comes first: the dispatcher taking the item into a batch, or its
    /// waiter giving up after [`Limits::queue_wait`]. An item is never both run and refused.
    taken: Arc<AtomicBool>,
    /// Set by the dispatcher when it holds the item back because its key is in a statement
    /// still out: the waiter then waits as a duplicate does, up to its in-flight wait, and
    /// answers 409 `request_in_progress` rather than 429.
    duplicate: Arc<AtomicBool>,
    /// Set by the dispatcher when it holds the item back because its account is in a
    /// statement still out: refused after its wait, it answers that the account is busy
    /// ([`DbError::AccountBusy`]), not that the service is at capacity.
    account_busy: Arc<AtomicBool>,
    /// What it locks or claims: made once, as the dispatcher may look at a held-back item
    /// many times.
    holds: Holds,
    /// When it was queued: what it waited in the process comes off its wait on the key's row.
    queued_at: Instant,
}

impl<E: Batched> Job<E> {
    /// The order items run in within a statement: (tenant, account) as bytes, then the key.
    fn order(&self) -> (TenantId, &[u8], Option<&str>) {
        (self.tenant, self.effect.lock_order().as_bytes(), self.claim.key())
    }
}

/// Runs effects of one kind in batches (see the module's documentation).
pub struct Batcher<E: Batched> {
    queue: mpsc::Sender<Job<E>>,
    queue_wait: Duration,
    /// The keys and accounts of the statements out, which the dispatcher keeps: a waiter
    /// whose key is among them when its queue wait ends is a duplicate, and one whose account
    /// is among them is refused as its account busy, even if the dispatcher has not read it
    /// (while every slot is out it reads nothing).
    held_out: HeldOut,
    /// Every slot is out, which the dispatcher keeps.
    full: Arc<AtomicBool>,
}

impl<E: Batched> Batcher<E> {
    /// Starts the batcher's dispatcher on the current tokio runtime; it stops when the
    /// batcher is dropped and the queued items have left.
    pub fn start(db: Db, limits: Limits, counters: Counters) -> Self {
        let (queue, jobs) = mpsc::channel(limits.queue.max(1));
        let out = Out::default();
        let held_out = Arc::clone(&out.held);
        let full = Arc::clone(&out.full);
        tokio::spawn(Dispatcher::new(db, jobs, limits, counters, out).run());
        Self {
            queue,
            queue_wait: limits.queue_wait,
            held_out,
            full,
        }
    }

    /// Payments are the database's work right now: every slot is out (the statements in
    /// flight are at the limit), or items are queued that the dispatcher has not taken yet.
    pub fn busy(&self) -> bool {
        self.full.load(Ordering::Relaxed) || self.queue.capacity() < self.queue.max_capacity()
    }

    /// Runs `effect` (in a batch when others are waiting) and gives its outcome.
    pub async fn run(&self, tenant: TenantId, claim: ClaimArgs, effect: E) -> Result<Outcome<E::Row>, DbError> {
        let (reply, mut answer) = oneshot::channel();
        let taken = Arc::new(AtomicBool::new(false));
        let duplicate = Arc::new(AtomicBool::new(false));
        let account_busy = Arc::new(AtomicBool::new(false));
        let inflight_wait = claim.inflight_wait();
        let holds = Holds {
            account: (tenant, effect.lock_order().to_owned()),
            key: claim.key().map(|k| (tenant, k.to_owned())),
        };
        let (key, account) = (holds.key.clone(), holds.account.clone());
        let job = Job {
            tenant,
            holds,
            claim,
            effect,
            reply,
            taken: Arc::clone(&taken),
            duplicate: Arc::clone(&duplicate),
            account_busy: Arc::clone(&account_busy),
            queued_at: Instant::now(),
        };
        self.queue.try_send(job).map_err(|err| match err {
            mpsc::error::TrySendError::Full(_) => DbError::Saturated,
            mpsc::error::TrySendError::Closed(_) => DbError::Transient(Arc::new(sqlx::Error::PoolClosed)),
        })?;
        // The sender is dropped unanswered only if the batch's task died (a panic), which
        // may have been after its commit.
        let crashed = || Err(DbError::Unknown(Arc::new(sqlx::Error::WorkerCrashed)));
        if let Ok(result) = tokio::time::timeout(self.queue_wait, &mut answer).await {
            return result.unwrap_or_else(|_| crashed());
        }
        // A duplicate of an item still out (held back for it, or not read yet because every
        // slot is out) waits as long as it would have waited on the key's row.
        let duplicate =
            duplicate.load(Ordering::Acquire) || key.is_some_and(|k| held(&self.held_out).keys.contains(&k));
        if duplicate {
            if let Ok(result) = tokio::time::timeout(inflight_wait.saturating_sub(self.queue_wait), &mut answer).await {
                return result.unwrap_or_else(|_| crashed());
            }
        }
        if !taken.swap(true, Ordering::AcqRel) {
            // Still queued or held back: refused, and the dispatcher will skip it.
            return Err(if duplicate {
                DbError::InProgress
            } else if account_busy.load(Ordering::Acquire) || held(&self.held_out).accounts.contains(&account) {
                DbError::AccountBusy
            } else {
                DbError::Saturated
            });
        }
        // Already in a batch: it runs, so its answer is awaited (a refusal now could hide a
        // commit).
        answer.await.unwrap_or_else(|_| crashed())
    }
}

/// Forms batches: waits for a free slot, then takes the held-back items that are free to go
/// and every waiting item (up to the limit) into one statement.
struct Dispatcher<E: Batched> {
    db: Db,
    jobs: mpsc::Receiver<Job<E>>,
    /// The queue is closed (the batcher was dropped).
    closed: bool,
    limits: Limits,
    counters: Counters,
    /// Statements that may be out at once.
    limit: Limit,
    /// Statements out now.
    in_flight: usize,
    /// What the statements still out hold.
    out: Out,
    /// When each tenant's payments last reached the dispatcher (see [`ACTIVE_WINDOW`]).
    seen: HashMap<TenantId, Instant>,
    /// Items whose account or key was out when they arrived, oldest first.
    held: VecDeque<Job<E>>,
    /// Items received while the dispatcher waited, not yet considered.
    arrived: Vec<Job<E>>,
    done: (mpsc::UnboundedSender<Finished>, mpsc::UnboundedReceiver<Finished>),
    /// The recent batch size: how long a free slot waits for its batch to fill.
    fill: Fill,
}

/// A statement that came back: what it held, and how long it took for how many payments
/// (`None` when it failed before it ran: no connection).
struct Finished {
    holds: Vec<Holds>,
    took: Option<(Duration, usize)>,
}

impl<E: Batched> Dispatcher<E> {
    fn new(db: Db, jobs: mpsc::Receiver<Job<E>>, limits: Limits, counters: Counters, out: Out) -> Self {
        Self {
            db,
            jobs,
            closed: false,
            limit: match limits.in_flight {
                Some(n) => Limit::fixed(n),
                None => Limit::adaptive(limits.initial, limits.ceiling),
            },
            in_flight: 0,
            limits,
            counters,
            out,
            seen: HashMap::new(),
            held: VecDeque::new(),
            arrived: Vec::new(),
            done: mpsc::unbounded_channel(),
            fill: Fill::default(),
        }
    }

    async fn run(mut self) {
        self.counters.limit.set(self.limit.current() as i64);
        loop {
            // A slot first: while the limit's statements are out, wait for one to come back.
            while self.in_flight >= self.limit.current() {
                // The dispatcher holds a sender itself, so this never ends.
                let Some(finished) = self.done.1.recv().await else {
                    return;
                };
                self.finish(finished);
            }
            let Some(batch) = self.next_batch().await else {
                return; // the batcher is gone and every item has left
            };
            self.launch(batch);
        }
    }

    /// The next batch to run: at least one item, none of which conflicts with a statement
    /// still out. `None` once the queue is closed and nothing is left. While another
    /// statement is out and few payments wait, the free slot waits a little for more
    /// ([`fill`]).
    async fn next_batch(&mut self) -> Option<Vec<Job<E>>> {
        let free_since = tokio::time::Instant::now();
        loop {
            while let Ok(finished) = self.done.1.try_recv() {
                self.finish(finished);
            }
            let waiting = self.arrived.len() + self.jobs.len();
            if let Some(until) = self
                .fill
                .wait_until(
                    self.out.items_total(),
                    waiting,
                    free_since,
                    self.limit.least_latency(),
                    tokio::time::Instant::now(),
                )
                .filter(|_| !self.closed)
            {
                tokio::select! {
                    finished = self.done.1.recv() => {
                        // The dispatcher holds a sender itself, so this never ends.
                        if let Some(finished) = finished {
                            self.finish(finished);
                        }
                    }
                    arrived = self.jobs.recv() => match arrived {
                        Some(job) => self.arrived.push(job),
                        None => self.closed = true,
                    },
                    () = tokio::time::sleep_until(until) => {}
                }
                continue;
            }
            let batch = self.gather();
            if !batch.is_empty() {
                return Some(batch);
            }
            // Nothing can go now: wait for an arrival or for a statement to come back.
            if self.closed && self.held.is_empty() && self.arrived.is_empty() && self.jobs.is_empty() {
                return None;
            }
            tokio::select! {
                finished = self.done.1.recv() => {
                    // The dispatcher holds a sender itself, so this never ends.
                    if let Some(finished) = finished {
                        self.finish(finished);
                    }
                }
                arrived = self.jobs.recv(), if !self.closed => match arrived {
                    Some(job) => self.arrived.push(job),
                    None => self.closed = true,
                },
            }
        }
    }

    /// Takes the held-back items now free to go, then the waiting ones, into a batch; holds
    /// back those whose account or key is out, or whose tenant has its share out. Skips items
    /// whose waiter gave up (429).
    fn gather(&mut self) -> Vec<Job<E>> {
        self.forget_idle();
        let mut batch = Batch {
            jobs: Vec::new(),
            max: self.limits.max_items.max(1),
            per_tenant: HashMap::new(),
        };
        let mut still_held = VecDeque::new();
        // Held back before: already counted.
        for job in std::mem::take(&mut self.held) {
            self.consider(job, false, &mut batch, &mut still_held);
        }
        // Received while the dispatcher waited, then what waits in the queue. Held-back
        // items count against the queue's bound: past it, arrivals stay in the channel,
        // which then refuses new ones (429). Every tenant that arrived is seen before any of
        // them is considered: the first one's items count the others' against its share.
        let arrived = std::mem::take(&mut self.arrived);
        for job in &arrived {
            self.mark_seen(job);
        }
        for job in arrived {
            self.consider(job, true, &mut batch, &mut still_held);
        }
        while batch.jobs.len() < batch.max && still_held.len() < self.limits.queue {
            let Ok(job) = self.jobs.try_recv() else { break };
            self.mark_seen(&job);
            self.consider(job, true, &mut batch, &mut still_held);
        }
        self.held = still_held;
        // An item is run only if its waiter has not given up meanwhile (then it never will).
        let mut jobs = batch.jobs;
        jobs.retain(|job| !job.taken.swap(true, Ordering::AcqRel));
        jobs
    }

    fn mark_seen(&mut self, job: &Job<E>) {
        self.seen.insert(job.tenant, Instant::now());
    }

    /// Forgets tenants not seen within [`ACTIVE_WINDOW`].
    fn forget_idle(&mut self) {
        let now = Instant::now();
        self.seen.retain(|_, at| now.duration_since(*at) < ACTIVE_WINDOW);
    }

    /// The most payments `tenant` may have in statements now: its share while another tenant
    /// is active (seen within [`ACTIVE_WINDOW`], or with payments in statements still out),
    /// else no limit.
    fn share_of(&self, tenant: TenantId) -> usize {
        let share = self.limits.tenant_share;
        if share == 0 {
            return usize::MAX;
        }
        let others = self.seen.keys().chain(self.out.items.keys()).any(|t| *t != tenant);
        if others {
            share
        } else {
            usize::MAX
        }
    }

    /// Puts `job` in the batch, or holds it back (counted when `new`) if its account or key
    /// is out, its tenant has its share out, or the batch is full; drops it if its waiter
    /// gave up.
    fn consider(&self, job: Job<E>, new: bool, batch: &mut Batch<E>, held: &mut VecDeque<Job<E>>) {
        if job.taken.load(Ordering::Acquire) {
            return; // refused while it waited
        }
        let taking = batch.per_tenant.get(&job.tenant).copied().unwrap_or(0);
        let blocked = self.out.blocks(&job.holds).or_else(|| {
            (self.out.items_of(job.tenant) + taking >= self.share_of(job.tenant)).then_some(Blocked::Share)
        });
        match blocked {
            None if batch.jobs.len() < batch.max => {
                batch.per_tenant.insert(job.tenant, taking + 1);
                batch.jobs.push(job);
            }
            None => held.push_back(job),
            Some(blocked) => {
                if new {
                    match blocked {
                        Blocked::Share => self.counters.held_for_share.inc(),
                        Blocked::Key | Blocked::Account => self.counters.held_back.inc(),
                    }
                }
                match blocked {
                    Blocked::Key => job.duplicate.store(true, Ordering::Release),
                    Blocked::Account => job.account_busy.store(true, Ordering::Release),
                    Blocked::Share => {}
                }
                held.push_back(job);
            }
        }
    }

    /// Marks what the batch holds as out, and runs it on its own task; what it held is
    /// released when it comes back.
    fn launch(&mut self, batch: Vec<Job<E>>) {
        self.fill.launched(batch.len());
        let holds: Vec<Holds> = batch.iter().map(|job| job.holds.clone()).collect();
        for h in &holds {
            self.out.insert(h);
        }
        self.in_flight += 1;
        self.note_full();
        let (db, counters, done) = (self.db.clone(), self.counters.clone(), self.done.0.clone());
        tokio::spawn(async move {
            let took = execute(&db, batch, &counters).await;
            let _ = done.send(Finished { holds, took });
        });
    }

    /// Tells the [`Batcher`] whether every slot is out ([`Batcher::busy`]).
    fn note_full(&self) {
        self.out
            .full
            .store(self.in_flight >= self.limit.current(), Ordering::Relaxed);
    }

    /// A statement came back: what it held is released, and its latency moves the limit.
    fn finish(&mut self, finished: Finished) {
        for h in &finished.holds {
            self.out.remove(h);
        }
        let in_flight = self.in_flight;
        self.in_flight = self.in_flight.saturating_sub(1);
        self.note_full();
        let Some((latency, items)) = finished.took else {
            return;
        };
        let waiting = !self.arrived.is_empty() || !self.jobs.is_empty() || !self.held.is_empty();
        let change = self.limit.observe(Sample {
            latency,
            items,
            in_flight,
            waiting,
        });
        match change {
            Change::Raised => self.counters.limit_changes.with_label_values(&["up"]).inc(),
            Change::Lowered => self.counters.limit_changes.with_label_values(&["down"]).inc(),
            Change::Held => {}
        }
        if change != Change::Held {
            self.counters.limit.set(self.limit.current() as i64);
            self.note_full();
        }
        if let Some(least) = self.limit.least_latency() {
            self.counters.least_latency.set(least.as_secs_f64());
        }
    }
}

/// A batch being formed.
struct Batch<E: Batched> {
    jobs: Vec<Job<E>>,
    max: usize,
    /// Items of each tenant in `jobs`.
    per_tenant: HashMap<TenantId, usize>,
}

/// The accounts and keys of the statements still out, and how many items of each tenant they
/// carry. No two statements share an account or key (an item that would is held back), so a
/// set suffices: a batch with several items on one account inserts and removes it once.
#[derive(Default)]
struct Out {
    /// Shared with the [`Batcher`]'s waiters, who only read it.
    held: HeldOut,
    /// Every slot is out (statements in flight at the limit); shared with the [`Batcher`],
    /// which only reads it.
    full: Arc<AtomicBool>,
    items: HashMap<TenantId, usize>,
}

type HeldOut = Arc<Mutex<Held>>;

/// The keys and accounts the statements out hold.
#[derive(Default)]
struct Held {
    keys: HashSet<(TenantId, String)>,
    accounts: HashSet<(TenantId, String)>,
}

/// The sets behind `held` (a panic while they were locked left them whole: each change is
/// one insert or remove).
fn held(held: &HeldOut) -> std::sync::MutexGuard<'_, Held> {
    held.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Why an item cannot go now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Blocked {
    /// Its key is out: it is a duplicate of an item still running.
    Key,
    /// Its account is out.
    Account,
    /// Its tenant has its share out while other tenants are active.
    Share,
}

impl Out {
    fn blocks(&self, holds: &Holds) -> Option<Blocked> {
        let held = held(&self.held);
        if holds.key.as_ref().is_some_and(|k| held.keys.contains(k)) {
            Some(Blocked::Key)
        } else if held.accounts.contains(&holds.account) {
            Some(Blocked::Account)
        } else {
            None
        }
    }

    /// Items in the statements out, every tenant's.
    fn items_total(&self) -> usize {
        self.items.values().sum()
    }

    fn items_of(&self, tenant: TenantId) -> usize {
        self.items.get(&tenant).copied().unwrap_or(0)
    }

    fn insert(&mut self, holds: &Holds) {
        *self.items.entry(holds.account.0).or_default() += 1;
        let mut held = held(&self.held);
        held.accounts.insert(holds.account.clone());
        if let Some(key) = &holds.key {
            held.keys.insert(key.clone());
        }
    }

    fn remove(&mut self, holds: &Holds) {
        if let Some(n) = self.items.get_mut(&holds.account.0) {
            *n -= 1;
            if *n == 0 {
                self.items.remove(&holds.account.0);
            }
        }
        let mut held = held(&self.held);
        held.accounts.remove(&holds.account);
        if let Some(key) = &holds.key {
            held.keys.remove(key);
        }
    }
}

/// Runs a batch and answers its items; gives the statement's latency and size when it ran
/// (a failed one too: a statement timeout is the slowest answer there is).
async fn execute<E: Batched>(db: &Db, mut batch: Vec<Job<E>>, counters: &Counters) -> Option<(Duration, usize)> {
    for job in &mut batch {
        job.claim.spend_inflight_wait(job.queued_at.elapsed());
    }
    if batch.len() == 1 {
        let job = batch.pop().expect("one job");
        let started = Instant::now();
        let result = alone(db, &job).await;
        let took = (!matches!(result, Err(DbError::Saturated | DbError::AccountBusy))).then(|| (started.elapsed(), 1));
        if result.is_ok() {
            counters.size.observe(1.0);
        }
        let _ = job.reply.send(result);
        return took;
    }
    batch.sort_by(|a, b| a.order().cmp(&b.order()));
    let mut conn = match db.conn().await {
        Ok(conn) => conn,
        Err(err) => {
            answer_all(batch, &err);
            return None;
        }
    };
    let waits: Vec<i32> = batch
        .iter_mut()
        .map(|j| j.claim.cap_inflight_wait(IN_BATCH_INFLIGHT_WAIT))
        .collect();
    let items: Vec<_> = batch.iter().map(|j| (j.tenant, &j.claim, &j.effect)).collect();
    let started = Instant::now();
    let result = run_items(&mut conn, &items).await;
    drop(items);
    let took = Some((started.elapsed(), batch.len()));
    match result {
        Ok(outcomes) => {
            counters.size.observe(batch.len() as f64);
            for (job, outcome) in batch.into_iter().zip(outcomes) {
                let _ = job.reply.send(Ok(outcome));
            }
        }
        Err(err) if err.is_one_items() => {
            // PostgreSQL rolled the statement back: each item runs again alone, with what is
            // left of its wait, and gets its own answer.
            drop(conn);
            let spent = i32::try_from(started.elapsed().as_millis()).unwrap_or(i32::MAX);
            for (job, wait) in batch.iter_mut().zip(waits) {
                job.claim.restore_inflight_wait(wait.saturating_sub(spent).max(1));
            }
            counters.split.inc();
            counters.failed.with_label_values(&["split"]).inc();
            tracing::info!(error = %err, items = batch.len(), "a batch was rolled back for one of its items; its items run alone");
            futures_util::future::join_all(batch.into_iter().map(async |job| {
                let result = alone(db, &job).await;
                let _ = job.reply.send(result);
            }))
            .await;
        }
        Err(err) => {
            let outcome = if matches!(err, DbError::Unknown(_)) {
                tracing::error!(error = %err, items = batch.len(), "a batch's outcome unknown: it may have committed; nothing runs again, every item answers 503");
                "unknown"
            } else {
                tracing::warn!(error = %err, items = batch.len(), "a batch refused as a whole; every item answers 503");
                "refused"
            };
            counters.failed.with_label_values(&[outcome]).inc();
            answer_all(batch, &err);
        }
    }
    took
}

/// Items in one statement, in the way that takes fewest round trips for the pooler: binary
/// parameters and a statement cached per connection when oncepay talks to PostgreSQL
/// itself; the statement rendered into one simple-protocol message through a
/// transaction-mode pooler (one round trip instead of four: docs/scaling.md).
async fn run_items<E: Batched>(
    conn: &mut Conn,
    items: &[(TenantId, &ClaimArgs, &E)],
) -> Result<Vec<Outcome<E::Row>>, DbError> {
    match conn.pooler() {
        Pooler::None => conn.run(async |c| E::run_batch(c, items).await).await,
        Pooler::Transaction => E::run_batch_rendered(conn, items).await,
    }
}

/// One item in a statement of its own, as without batching (through a transaction-mode
/// pooler, a rendered batch of one: see [`run_items`]).
async fn alone<E: Batched>(db: &Db, job: &Job<E>) -> Result<Outcome<E::Row>, DbError> {
    let mut conn = db.conn().await?;
    match conn.pooler() {
        Pooler::None => {
            conn.run(async |c| job.effect.run(c, job.tenant, &job.claim).await)
                .await
        }
        Pooler::Transaction => {
            let mut answers = E::run_batch_rendered(&mut conn, &[(job.tenant, &job.claim, &job.effect)]).await?;
            // One answer per item, or the call failed (`settle_batch`).
            answers
                .pop()
                .ok_or_else(|| DbError::from(sqlx::Error::Decode("a batch of one answered nothing".into())))
        }
    }
}

/// The same failure for every item of a batch that could not run, or whose outcome is not
/// known.
fn answer_all<E: Batched>(batch: Vec<Job<E>>, err: &DbError) {
    for job in batch {
        let _ = job.reply.send(Err(err.copy()));
    }
}

#[cfg(test)]
mod tests {
    //! The dispatcher's scheduling alone: which waiting payments go into the next statement,
    //! which are held back and why, and the order a statement runs its items in. No
    //! statement runs: the dispatcher's database is a pool that never connects.

    use super::*;
    use crate::domain::{AccountId, Amount};
    use crate::idempotency::Claim;
    use crate::ledger::Pay;
    use crate::operation::Operation;

    fn counters() -> Counters {
        let histogram = prometheus::Histogram::with_opts(prometheus::HistogramOpts::new("size", "size")).unwrap();
        let vec = || IntCounterVec::new(prometheus::Opts::new("failed", "failed"), &["outcome"]).unwrap();
        Counters {
            size: histogram,
            split: IntCounter::new("split", "split").unwrap(),
            failed: vec(),
            held_back: IntCounter::new("held_back", "held back").unwrap(),
            held_for_share: IntCounter::new("held_for_share", "held for share").unwrap(),
            limit: IntGauge::new("limit", "limit").unwrap(),
            limit_changes: IntCounterVec::new(prometheus::Opts::new("changes", "changes"), &["direction"]).unwrap(),
            least_latency: Gauge::new("least", "least").unwrap(),
        }
    }

    fn dispatcher(max_items: usize, tenant_share: usize) -> Dispatcher<Pay> {
        let options = sqlx::postgres::PgConnectOptions::new().host("127.0.0.1").port(1);
        let (_queue, jobs) = mpsc::channel(64);
        let limits = Limits {
            max_items,
            in_flight: Some(2),
            initial: 2,
            ceiling: 2,
            queue: 64,
            queue_wait: Duration::from_secs(2),
            tenant_share,
        };
        Dispatcher::new(Db::direct(options, 1), jobs, limits, counters(), Out::default())
    }

    /// A payment of `tenant` on `account`, with `key` (or none).
    fn job(tenant: TenantId, account: &str, key: Option<&str>) -> Job<Pay> {
        let claim = key.map(|k| Claim {
            key: k.to_owned(),
            derived: false,
            fingerprint: [7; 32],
            window: Duration::from_secs(60),
        });
        let spec = Operation::Pay.spec();
        let claim = ClaimArgs::new(spec, spec.path.to_owned(), claim.as_ref(), Duration::from_secs(5));
        let effect = Pay {
            account: AccountId::parse(account).unwrap(),
            amount: Amount::new(1).unwrap(),
        };
        let holds = Holds {
            account: (tenant, account.to_owned()),
            key: claim.key().map(|k| (tenant, k.to_owned())),
        };
        Job {
            tenant,
            claim,
            effect,
            reply: oneshot::channel().0,
            taken: Arc::new(AtomicBool::new(false)),
            duplicate: Arc::new(AtomicBool::new(false)),
            account_busy: Arc::new(AtomicBool::new(false)),
            holds,
            queued_at: Instant::now(),
        }
    }

    fn accounts(batch: &[Job<Pay>]) -> Vec<&str> {
        batch.iter().map(|j| j.effect.account.as_str()).collect()
    }

    #[tokio::test]
    async fn waiting_payments_leave_together_up_to_the_batch_size_the_rest_next() {
        let mut d = dispatcher(3, 0);
        let t = TenantId::new_random();
        for a in ["a", "b", "c", "d", "e"] {
            d.arrived.push(job(t, a, Some(a)));
        }
        assert_eq!(accounts(&d.gather()), ["a", "b", "c"]);
        assert_eq!(accounts(&d.gather()), ["d", "e"], "the held ones go first next time");
        assert!(d.gather().is_empty());
    }

    #[tokio::test]
    async fn a_payment_whose_account_or_key_is_out_is_held_back_until_it_comes_back() {
        let mut d = dispatcher(32, 0);
        let t = TenantId::new_random();
        let out = [job(t, "hot", Some("k1")), job(t, "other", Some("dup"))];
        for j in &out {
            d.out.insert(&j.holds);
        }
        let same_account = job(t, "hot", Some("k2"));
        let same_key = job(t, "elsewhere", Some("dup"));
        let duplicate = Arc::clone(&same_key.duplicate);
        d.arrived.extend([same_account, same_key, job(t, "free", Some("k3"))]);
        assert_eq!(
            accounts(&d.gather()),
            ["free"],
            "only the payment that conflicts with nothing"
        );
        assert!(
            duplicate.load(Ordering::Acquire),
            "a held key is a duplicate: it waits as one (409)"
        );
        assert_eq!(d.counters.held_back.get(), 2);
        for j in &out {
            d.out.remove(&j.holds);
        }
        assert_eq!(accounts(&d.gather()), ["hot", "elsewhere"], "released, in their order");
        // An item whose waiter gave up (429) is dropped, never run.
        let gone = job(t, "late", Some("k4"));
        gone.taken.store(true, Ordering::Release);
        d.arrived.push(gone);
        assert!(d.gather().is_empty());
    }

    #[tokio::test]
    async fn beside_another_active_tenant_a_tenant_has_its_share_out_and_alone_no_limit() {
        let mut d = dispatcher(32, 2);
        let (busy, quiet) = (TenantId::new_random(), TenantId::new_random());
        // Alone, a tenant takes the whole batch.
        for i in 0..5 {
            d.arrived.push(job(busy, &format!("b{i}"), None));
        }
        let alone = d.gather();
        assert_eq!(alone.len(), 5);
        for j in &alone {
            d.out.insert(&j.holds);
        }
        // Another tenant arrives: the busy one, with five out, gets nothing more until it is
        // back under its share; the quiet one goes at once.
        d.arrived.extend([job(busy, "b5", None), job(quiet, "q0", None)]);
        assert_eq!(accounts(&d.gather()), ["q0"]);
        assert_eq!(d.counters.held_for_share.get(), 1);
        for j in &alone {
            d.out.remove(&j.holds);
        }
        assert_eq!(accounts(&d.gather()), ["b5"], "its share free again");
    }

    #[test]
    fn a_statement_runs_its_items_in_one_lock_order_tenant_then_account_bytes_then_key() {
        let (t1, t2) = {
            let (a, b) = (TenantId::new_random(), TenantId::new_random());
            if a < b {
                (a, b)
            } else {
                (b, a)
            }
        };
        let mut items = [
            job(t2, "a", Some("x")),
            job(t1, "b", Some("y")),
            job(t1, "B", Some("z")),
            job(t1, "a", Some("w")),
        ];
        items.sort_by(|a, b| a.order().cmp(&b.order()));
        let order: Vec<(TenantId, &str)> = items.iter().map(|j| (j.tenant, j.effect.account.as_str())).collect();
        // Bytes: "B" (0x42) before "a" (0x61) before "b", whatever a collation would say.
        assert_eq!(order, [(t1, "B"), (t1, "a"), (t1, "b"), (t2, "a")]);
    }
}
