//! The test's own ledger of logical operations (a key and an amount each), the answers
//! they got under faults, and the proof afterwards that each was charged exactly once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use sqlx::PgPool;
use uuid::Uuid;

use crate::harness::{self, Tenant};

/// One attempt's answer, classified.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// 201: charged (now or earlier, `replayed`).
    Charged { payment_id: Uuid, replayed: bool },
    /// 409 / 429 / 503 with `Retry-After`: nothing decided, try again.
    Retry { status: u16, code: String },
    /// No HTTP answer (connection refused or reset, timeout).
    NoAnswer(String),
    /// Anything else: a bug under this test.
    Unexpected { status: u16, body: String },
}

#[derive(Clone, Debug)]
pub struct Attempt {
    pub outcome: Outcome,
    pub elapsed: Duration,
}

pub struct Op {
    pub key: String,
    pub amount: i64,
}

/// Every attempt of every operation, by operation index.
pub struct Ledger {
    pub ops: Vec<Op>,
    pub attempts: Mutex<HashMap<usize, Vec<Attempt>>>,
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .connect_timeout(Duration::from_secs(2))
        .pool_max_idle_per_host(64)
        .build()
        .unwrap()
}

/// One `POST /payments` with the op's key.
pub async fn pay(client: &reqwest::Client, address: &str, tenant: &Tenant, op: &Op) -> Attempt {
    let started = Instant::now();
    let sent = client
        .post(format!("{address}/payments"))
        .bearer_auth(&tenant.api_key)
        .header("Idempotency-Key", &op.key)
        .json(&serde_json::json!({ "amount": op.amount }))
        .send()
        .await;
    let outcome = match sent {
        Err(err) => Outcome::NoAnswer(err.to_string()),
        Ok(response) => {
            let status = response.status().as_u16();
            let retry_after = response.headers().get("retry-after").is_some();
            let replayed = response
                .headers()
                .get("idempotency-replayed")
                .is_some_and(|v| v == "true");
            match response.text().await {
                Err(err) => Outcome::NoAnswer(err.to_string()),
                Ok(text) => classify(status, retry_after, replayed, text),
            }
        }
    };
    Attempt {
        outcome,
        elapsed: started.elapsed(),
    }
}

fn classify(status: u16, retry_after: bool, replayed: bool, text: String) -> Outcome {
    let body: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let code = body["code"].as_str().unwrap_or_default().to_owned();
    let retryable = matches!(
        (status, code.as_str()),
        (409, "request_in_progress") | (429, "overloaded") | (503, "temporarily_unavailable")
    );
    match status {
        201 => match body["id"].as_str().and_then(|id| Uuid::parse_str(id).ok()) {
            Some(payment_id) => Outcome::Charged { payment_id, replayed },
            None => Outcome::Unexpected { status, body: text },
        },
        _ if retryable && retry_after => Outcome::Retry { status, code },
        _ => Outcome::Unexpected { status, body: text },
    }
}

impl Ledger {
    pub fn new(count: usize) -> Self {
        let ops = (0..count)
            .map(|i| Op {
                key: format!("chaos-{}", Uuid::new_v4()),
                amount: 1 + (i as i64 * 7919) % 1000,
            })
            .collect();
        Self {
            ops,
            attempts: Mutex::new(HashMap::new()),
        }
    }

    pub fn record(&self, index: usize, attempt: Attempt) -> Attempt {
        let mut attempts = self.attempts.lock().unwrap();
        attempts.entry(index).or_default().push(attempt.clone());
        attempt
    }

    pub fn all_attempts(&self) -> Vec<Attempt> {
        self.attempts.lock().unwrap().values().flatten().cloned().collect()
    }

    /// Sends op `index` once to `address` and records the answer.
    pub async fn send(&self, client: &reqwest::Client, address: &str, tenant: &Tenant, index: usize) -> Attempt {
        let attempt = pay(client, address, tenant, &self.ops[index]).await;
        self.record(index, attempt)
    }

    /// Steady load: `workers` loops each sending the next op once (round robin over the
    /// servers), until `stop` or the ledger runs out; then the ledger keeps only the ops sent.
    pub async fn load(
        &mut self,
        client: &reqwest::Client,
        addresses: &[String],
        tenant: &Tenant,
        workers: usize,
        stop: &AtomicBool,
    ) {
        let next = AtomicUsize::new(0);
        let this = &*self;
        let worker = || async {
            while !stop.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= this.ops.len() {
                    return;
                }
                this.send(client, &addresses[i % addresses.len()], tenant, i).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        futures_util::future::join_all((0..workers).map(|_| worker())).await;
        let sent = next.load(Ordering::Relaxed).min(self.ops.len());
        self.ops.truncate(sent);
    }

    /// Answers of one kind, counted.
    pub fn count(&self, matches: impl Fn(&Outcome) -> bool) -> usize {
        self.all_attempts().iter().filter(|a| matches(&a.outcome)).count()
    }

    /// Retries every op with its key on the live servers until it is charged: at most 30
    /// attempts per op, one second apart when told `Retry-After`.
    pub async fn settle(&self, client: &reqwest::Client, live: &[&str], tenant: &Tenant) {
        stream::iter(0..self.ops.len())
            .for_each_concurrent(16, |i| async move {
                for attempt in 0..30 {
                    let address = live[(i + attempt) % live.len()];
                    match self.send(client, address, tenant, i).await.outcome {
                        Outcome::Charged { .. } | Outcome::Unexpected { .. } => return,
                        Outcome::Retry { .. } => tokio::time::sleep(Duration::from_secs(1)).await,
                        Outcome::NoAnswer(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
            })
            .await;
    }

    /// The proof: no unexpected answer; every op has one payment row, the one every 201 named;
    /// no other payment for the tenant; the balance is opening - sum; no key still in flight;
    /// the real audit clean. Prints the figures (`--no-capture` shows them).
    pub async fn verify(&self, pool: &PgPool, client: &reqwest::Client, live: &str, tenant: &Tenant) {
        let attempts = self.attempts.lock().unwrap().clone();
        let unexpected: Vec<_> = attempts
            .values()
            .flatten()
            .filter(|a| matches!(a.outcome, Outcome::Unexpected { .. }))
            .collect();
        assert!(unexpected.is_empty(), "unexpected answers: {unexpected:?}");

        let rows: Vec<(Option<String>, Uuid)> =
            sqlx::query_as("SELECT idempotency_key, payment_id FROM payments WHERE tenant_id = $1")
                .bind(tenant.id)
                .fetch_all(pool)
                .await
                .unwrap();
        let mut by_key: HashMap<String, Vec<Uuid>> = HashMap::new();
        for (key, id) in rows {
            by_key
                .entry(key.expect("every chaos payment is keyed"))
                .or_default()
                .push(id);
        }
        let charged_twice = by_key.values().filter(|ids| ids.len() > 1).count();
        let lost = self.ops.iter().filter(|op| !by_key.contains_key(&op.key)).count();
        assert_eq!(charged_twice, 0, "operations charged more than once");
        assert_eq!(lost, 0, "operations never charged");
        assert_eq!(by_key.len(), self.ops.len(), "payments under keys the test never sent");

        for (i, op) in self.ops.iter().enumerate() {
            let stored = by_key[&op.key][0];
            for attempt in &attempts[&i] {
                if let Outcome::Charged { payment_id, .. } = attempt.outcome {
                    assert_eq!(payment_id, stored, "a 201 named another payment than the one stored");
                }
            }
            // No key wedged: with every fault over, the key answers at once with its replay.
            let last = pay(client, live, tenant, op).await.outcome;
            assert_eq!(
                last,
                Outcome::Charged {
                    payment_id: stored,
                    replayed: true
                },
                "key {} does not replay",
                op.key
            );
        }

        let balance: i64 =
            sqlx::query_scalar("SELECT balance FROM accounts WHERE tenant_id = $1 AND account_id = 'main'")
                .bind(tenant.id)
                .fetch_one(pool)
                .await
                .unwrap();
        let total: i64 = self.ops.iter().map(|op| op.amount).sum();
        assert_eq!(
            balance,
            tenant.opening - total,
            "the balance is opening - the sum of the operations"
        );
        harness::assert_audit_clean().await;

        eprintln!(
            "chaos figures: operations={} requests={} charged_twice={charged_twice} lost={lost}",
            self.ops.len(),
            attempts.values().map(Vec::len).sum::<usize>()
        );
    }
}
