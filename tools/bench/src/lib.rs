//! What the benchmark binaries of `make bench` share (`oncepay-loadgen` writes it,
//! `oncepay-bench-report` reads it): the one-line JSON record each measured step writes, and
//! how its latencies are summarised.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// One measured step: one side (pgbench, or oncepay with one or three instances), one
/// scenario, one concurrency, one key-table size, one round of the alternation.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    /// `pgbench` (oncepay's own statement), `yardstick` (the fixed minimal transaction of
    /// bench/yardstick), `oncepay`, `oncepay x3`, ...
    pub side: String,
    pub scenario: String,
    pub concurrency: u32,
    /// Rows in `idempotency_keys` when the step started (pre-filled with SQL).
    pub key_rows: u64,
    pub round: u32,
    pub duration_secs: f64,
    /// Answered as expected.
    pub requests: u64,
    /// Anything else: a wrong status, a transport error, a failed pgbench transaction.
    pub errors: u64,
    pub throughput: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    /// User + system CPU seconds of the server process(es) per request; `None` for pgbench,
    /// whose server is PostgreSQL itself.
    pub cpu_secs_per_request: Option<f64>,
    /// CPU seconds per request of the whole PostgreSQL cluster (every backend and auxiliary
    /// process, exited ones included); `None` when the step was not given the postmaster.
    #[serde(default)]
    pub pg_cpu_secs_per_request: Option<f64>,
    /// CPU seconds per request of the load generator: oncepay-loadgen itself on the HTTP side,
    /// the pgbench process on the SQL side.
    #[serde(default)]
    pub client_cpu_secs_per_request: Option<f64>,
    /// CPU seconds per request of the card processor (localstripe) in the top-up steps, on
    /// both sides (through oncepay, and driven directly); `None` elsewhere.
    #[serde(default)]
    pub processor_cpu_secs_per_request: Option<f64>,
    /// Replays answered from the instances' memory during the step, from their `/metrics`
    /// (`oncepay_replay_cache_hits_total`); `None` where the servers do not export it.
    #[serde(default)]
    pub cache_hits: Option<u64>,
    #[serde(default)]
    pub cache_misses: Option<u64>,
    /// Free text, e.g. "purge running".
    #[serde(default)]
    pub note: String,
    /// The share of the machine's CPU time that the hypervisor gave to other guests during
    /// the step (`steal` over all ticks of /proc/stat's `cpu` line): a shared host's noise,
    /// recorded so that a step it hit can be told from one the code slowed down.
    #[serde(default)]
    pub host_steal: Option<f64>,
    /// The batch statements the oncepay instances allowed themselves in flight when the step
    /// ended (`oncepay_db_batches_in_flight_limit`, the mean over the instances): the limit the
    /// adaptive batcher settled on; `None` where the servers do not export it.
    #[serde(default)]
    pub batch_limit: Option<f64>,
    /// The payments' batch statements during the step, summed over the instances
    /// (`oncepay_db_batch_size` of their `/metrics`); `None` where the servers do not export it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batches: Option<Batches>,
}

/// Batch statements that committed during a step: how many, the payments they carried, and
/// how many carried one payment (a statement's fixed costs, its round trip, wake-ups and
/// commit, then fall on that payment alone).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Batches {
    pub statements: u64,
    pub payments: u64,
    pub singles: u64,
}

impl Batches {
    /// What was counted since `before` (a counter that went back, a restarted server, reads
    /// as nothing rather than as a negative count).
    pub fn since(self, before: Batches) -> Batches {
        Batches {
            statements: self.statements.saturating_sub(before.statements),
            payments: self.payments.saturating_sub(before.payments),
            singles: self.singles.saturating_sub(before.singles),
        }
    }

    pub fn plus(self, other: Batches) -> Batches {
        Batches {
            statements: self.statements + other.statements,
            payments: self.payments + other.payments,
            singles: self.singles + other.singles,
        }
    }

    /// Payments per statement; `None` without a statement.
    pub fn mean_size(&self) -> Option<f64> {
        (self.statements > 0).then(|| self.payments as f64 / self.statements as f64)
    }

    /// The share of statements that carried one payment; `None` without a statement.
    pub fn single_share(&self) -> Option<f64> {
        (self.statements > 0).then(|| self.singles as f64 / self.statements as f64)
    }
}

/// Latencies in microseconds, 1 µs to 60 s at three significant figures.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds")
}

/// The latency fields of a [`Record`] from a histogram in microseconds.
pub fn percentiles_ms(h: &Histogram<u64>) -> (f64, f64, f64) {
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    (ms(0.50), ms(0.99), ms(0.999))
}
