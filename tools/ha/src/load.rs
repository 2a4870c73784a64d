//! The clients and what they saw: every operation with its key, every acknowledgement with
//! the resource it names, every non-2xx answer.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use oncepay_client::{Backoff, BudgetConfig, Client, ClientConfig, ClientError, IdempotencyKey, Reply};
use rand::Rng;

/// An operation that keeps failing with an unknown outcome is sent again, with the same key,
/// until this long after its first attempt; past it, it counts as unfinished.
const COMPLETE_WITHIN: Duration = Duration::from_secs(120);
/// Opening balance of each client's account (the contract's maximum).
const OPENING_BALANCE: i64 = 1_000_000_000_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Open,
    Pay,
    Refund,
    Transfer,
}

/// One acknowledged (2xx) operation: its key and the resource the answer named.
#[derive(Clone, Debug)]
pub struct Ack {
    pub kind: Kind,
    pub key: String,
    /// Account id (open), payment id (pay, refund), transfer id (transfer).
    pub resource: String,
}

#[derive(Default)]
struct Books {
    operations: u64,
    acks: Vec<Ack>,
    /// Seconds since the start at which a payment was acknowledged.
    payment_acks: Vec<f64>,
    statuses: HashMap<String, u64>,
    unfinished: u64,
    rejected: u64,
    /// Acknowledged payments sent again, on purpose, with their key.
    replays: u64,
    /// Replays whose answer named another payment than the first answer did.
    replay_mismatches: u64,
}

pub struct Journal {
    start: Instant,
    books: Mutex<Books>,
}

pub struct Summary {
    pub operations: u64,
    pub acknowledged: u64,
    pub unfinished: u64,
    pub rejected: u64,
    pub refunds: u64,
    pub transfers: u64,
    pub statuses: HashMap<String, u64>,
    pub replays: u64,
    pub replay_mismatches: u64,
}

/// What a failed attempt is counted as: its HTTP status, or the transport failure's code.
fn label(err: &ClientError) -> String {
    match err {
        ClientError::DeadlineExceeded { last, .. } | ClientError::BudgetExhausted { last, .. } => label(last),
        ClientError::Problem(p) => p.status.to_string(),
        other => other.code().to_owned(),
    }
}

impl Journal {
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            books: Mutex::new(Books::default()),
        }
    }

    fn books(&self) -> std::sync::MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn now(&self) -> f64 {
        crate::secs_since(self.start)
    }

    fn saw(&self, err: &ClientError) {
        *self.books().statuses.entry(label(err)).or_default() += 1;
    }

    pub fn acks(&self) -> Vec<Ack> {
        self.books().acks.clone()
    }

    /// For a fault at `from`, recovered by `to`: the longest stretch of [from, to] without any
    /// acknowledged payment, and when it began (seconds after `from`).
    pub fn unavailability(&self, from: f64, to: f64) -> (f64, f64) {
        let mut times: Vec<f64> = self
            .books()
            .payment_acks
            .iter()
            .copied()
            .filter(|t| *t >= from && *t <= to)
            .collect();
        times.sort_by(f64::total_cmp);
        let (mut longest, mut began) = (0.0_f64, 0.0_f64);
        let mut previous = from;
        for t in times.iter().copied().chain([to]) {
            if t - previous > longest {
                (longest, began) = (t - previous, previous - from);
            }
            previous = t;
        }
        (longest, began)
    }

    pub fn summary(&self) -> Summary {
        let books = self.books();
        let count = |kind| books.acks.iter().filter(|a| a.kind == kind).count() as u64;
        Summary {
            operations: books.operations,
            acknowledged: books.acks.len() as u64,
            unfinished: books.unfinished,
            rejected: books.rejected,
            refunds: count(Kind::Refund),
            transfers: count(Kind::Transfer),
            statuses: books.statuses.clone(),
            replays: books.replays,
            replay_mismatches: books.replay_mismatches,
        }
    }

    /// One logical operation: a fresh key, sent again with that same key after every failure
    /// whose outcome is unknown (the client itself already retries within its deadline),
    /// until acknowledged or [`COMPLETE_WITHIN`] has passed.
    async fn operation<T, F, Fut>(&self, kind: Kind, call: F, resource: impl Fn(&T) -> String) -> Option<T>
    where
        F: Fn(IdempotencyKey) -> Fut,
        Fut: Future<Output = Result<Reply<T>, ClientError>>,
    {
        self.operation_with(kind, IdempotencyKey::generate(), call, resource)
            .await
    }

    /// [`Journal::operation`] with the key given.
    async fn operation_with<T, F, Fut>(
        &self,
        kind: Kind,
        key: IdempotencyKey,
        call: F,
        resource: impl Fn(&T) -> String,
    ) -> Option<T>
    where
        F: Fn(IdempotencyKey) -> Fut,
        Fut: Future<Output = Result<Reply<T>, ClientError>>,
    {
        let first = Instant::now();
        self.books().operations += 1;
        loop {
            match call(key.clone()).await {
                Ok(reply) => {
                    let at = self.now();
                    let mut books = self.books();
                    if kind == Kind::Pay {
                        books.payment_acks.push(at);
                    }
                    books.acks.push(Ack {
                        kind,
                        key: key.as_str().to_owned(),
                        resource: resource(&reply.value),
                    });
                    return Some(reply.value);
                }
                Err(err) => {
                    self.saw(&err);
                    if !err.outcome_unknown() {
                        eprintln!("oncepay-ha: {kind:?} with key {key} rejected: {err}");
                        self.books().rejected += 1;
                        return None;
                    }
                    if first.elapsed() >= COMPLETE_WITHIN {
                        eprintln!("oncepay-ha: {kind:?} with key {key} unfinished after {COMPLETE_WITHIN:?}: {err}");
                        self.books().unfinished += 1;
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

impl Journal {
    /// An acknowledged operation sent again with its key, on purpose, as a client whose
    /// answer was lost would (and on another instance than the first time, so that the
    /// replay is read from the database, through the failovers, rather than from the first
    /// instance's replay cache). It must name the same resource. Sent again after a failure
    /// whose outcome is unknown, like any operation; a refusal counts as rejected.
    async fn replay<T, F, Fut>(&self, key: &IdempotencyKey, call: F, resource: impl Fn(&T) -> String, expected: &str)
    where
        F: Fn(IdempotencyKey) -> Fut,
        Fut: Future<Output = Result<Reply<T>, ClientError>>,
    {
        let first = Instant::now();
        loop {
            match call(key.clone()).await {
                Ok(reply) => {
                    let mut books = self.books();
                    books.replays += 1;
                    if resource(&reply.value) != expected {
                        eprintln!("oncepay-ha: the replay of key {key} named another resource than {expected}");
                        books.replay_mismatches += 1;
                    }
                    return;
                }
                Err(err) => {
                    self.saw(&err);
                    if !err.outcome_unknown() || first.elapsed() >= COMPLETE_WITHIN {
                        eprintln!("oncepay-ha: the replay of key {key} failed: {err}");
                        self.books().rejected += 1;
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

/// One client per oncepay instance. Every failed attempt is counted by the observer; the
/// budget is sized so that the retry budget never makes an operation give up during a fault
/// (the point here is that every operation completes, with its one key).
pub fn clients(urls: &[String], api_key: &str, journal: &Arc<Journal>) -> anyhow::Result<Vec<Client>> {
    let config = ClientConfig {
        attempt_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(1),
        max_attempts: 200,
        deadline: Duration::from_secs(30),
        backoff: Backoff {
            base: Duration::from_millis(50),
            cap: Duration::from_millis(1_000),
        },
        budget: BudgetConfig {
            capacity: 100_000.0,
            refill_per_sec: 10_000.0,
        },
    };
    urls.iter()
        .map(|url| {
            let journal = journal.clone();
            Client::builder(url, api_key)
                .config(config.clone())
                .on_retry(move |note| journal.saw(note.error))
                .build()
                .with_context(|| format!("client of {url}"))
        })
        .collect()
}

fn account_of(worker: usize) -> String {
    format!("ha-{worker}")
}

/// Every worker pays from an account of its own, so that 32 clients do not queue on one row.
pub async fn open_accounts(clients: &[Client], journal: &Journal, workers: usize) -> anyhow::Result<()> {
    for worker in 0..workers {
        let client = &clients[worker % clients.len()];
        let id = account_of(worker);
        journal
            .operation(
                Kind::Open,
                |key| {
                    let id = id.clone();
                    async move { client.open_account(&id, Some(OPENING_BALANCE), &key).await }
                },
                |a| a.id.clone(),
            )
            .await
            .with_context(|| format!("cannot open account {id}"))?;
    }
    Ok(())
}

/// Pays, refunds some of its own payments and transfers to the next worker's account, until
/// `stop`; sends a third of its payments again with their key through `other` (another
/// instance), a deliberate replay.
pub async fn worker(worker: usize, client: Client, other: Client, journal: Arc<Journal>, stop: Arc<AtomicBool>) {
    let account = account_of(worker);
    let to = account_of((worker + 1) % crate::CLIENTS);
    let mut unrefunded: Vec<uuid::Uuid> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let roll = rand::thread_rng().gen_range(0..100);
        let amount = rand::thread_rng().gen_range(1..=1_000);
        if roll < 25 && !unrefunded.is_empty() {
            let payment = unrefunded.swap_remove(0);
            journal
                .operation(
                    Kind::Refund,
                    |key| {
                        let client = &client;
                        async move { client.refund(payment, &key).await }
                    },
                    |r| r.id.to_string(),
                )
                .await;
        } else if roll < 40 {
            journal
                .operation(
                    Kind::Transfer,
                    |key| {
                        let (client, account, to) = (&client, &account, &to);
                        async move { client.transfer(account, to, amount, &key).await }
                    },
                    |t| t.id.to_string(),
                )
                .await;
        } else {
            let key = IdempotencyKey::generate();
            let pay_through = |client: &Client| {
                let (client, account) = (client.clone(), account.clone());
                move |key: IdempotencyKey| {
                    let (client, account) = (client.clone(), account.clone());
                    async move { client.pay(amount, Some(&account), &key).await }
                }
            };
            let paid = journal
                .operation_with(Kind::Pay, key.clone(), pay_through(&client), |p| p.id.to_string())
                .await;
            if let Some(p) = paid {
                if roll % 3 == 0 {
                    journal
                        .replay(&key, pay_through(&other), |p| p.id.to_string(), &p.id.to_string())
                        .await;
                }
                unrefunded.push(p.id);
            }
        }
    }
}
