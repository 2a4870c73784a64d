//! Prometheus metrics (contract section 6b), one registry per app so that each instance
//! (and each test's app) counts only its own requests.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    /// `oncepay_requests_total{route,outcome}`: `replayed` apart from `created` is how an
    /// operator tells "retries doubled" from "requests doubled".
    pub requests: IntCounterVec,
    pub duration: HistogramVec,
    /// Replays and keyless requests per tenant: whose retries grew, whose clients still
    /// send no key (a tenant's migration to keys, watched).
    pub replays_by_tenant: IntCounterVec,
    pub keyless_by_tenant: IntCounterVec,
    pub purged_keys: IntCounter,
    pub purge_runs: IntCounter,
    pool_connections: IntGaugeVec,
    /// Requests waiting for a pooled connection right now.
    pub pool_waiting: IntGauge,
    /// Replays answered from this process's memory, and keyed requests it had to ask the
    /// database about; entries held.
    pub replay_cache_hits: IntCounter,
    pub replay_cache_misses: IntCounter,
    pub replay_cache_entries: IntGauge,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("oncepay_requests_total", "HTTP requests by route and outcome"),
            &["route", "outcome"],
        )
        .expect("valid metric");
        let duration = HistogramVec::new(
            HistogramOpts::new("oncepay_request_duration_seconds", "HTTP request latency by route").buckets(vec![
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
            ]),
            &["route"],
        )
        .expect("valid metric");
        let replays_by_tenant = IntCounterVec::new(
            Opts::new("oncepay_replays_total", "Replayed answers by tenant"),
            &["tenant"],
        )
        .expect("valid metric");
        let keyless_by_tenant = IntCounterVec::new(
            Opts::new(
                "oncepay_keyless_requests_total",
                "Keyless requests processed unprotected (policy allow) by tenant",
            ),
            &["tenant"],
        )
        .expect("valid metric");
        let purged_keys = IntCounter::new("oncepay_purged_keys_total", "Idempotency-key rows deleted by purges")
            .expect("valid metric");
        let purge_runs =
            IntCounter::new("oncepay_purge_runs_total", "Purge runs completed by this process").expect("valid metric");
        let pool_connections = IntGaugeVec::new(
            Opts::new("oncepay_db_pool_connections", "Database pool connections by state"),
            &["state"],
        )
        .expect("valid metric");
        let pool_waiting = IntGauge::new("oncepay_db_pool_waiting", "Requests waiting for a database connection")
            .expect("valid metric");
        let replay_cache_hits = IntCounter::new(
            "oncepay_replay_cache_hits_total",
            "Keyed requests answered from this process's replay cache (replays and reused keys)",
        )
        .expect("valid metric");
        let replay_cache_misses = IntCounter::new(
            "oncepay_replay_cache_misses_total",
            "Keyed requests the replay cache did not know (asked the database)",
        )
        .expect("valid metric");
        let replay_cache_entries = IntGauge::new(
            "oncepay_replay_cache_entries",
            "Finished results held in this process's replay cache",
        )
        .expect("valid metric");
        for collector in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(duration.clone()),
            Box::new(replays_by_tenant.clone()),
            Box::new(keyless_by_tenant.clone()),
            Box::new(purged_keys.clone()),
            Box::new(purge_runs.clone()),
            Box::new(pool_connections.clone()),
            Box::new(pool_waiting.clone()),
            Box::new(replay_cache_hits.clone()),
            Box::new(replay_cache_misses.clone()),
            Box::new(replay_cache_entries.clone()),
        ] {
            registry.register(collector).expect("metric registered once");
        }
        Self {
            registry,
            requests,
            duration,
            replays_by_tenant,
            keyless_by_tenant,
            purged_keys,
            purge_runs,
            pool_connections,
            pool_waiting,
            replay_cache_hits,
            replay_cache_misses,
            replay_cache_entries,
        }
    }

    /// Counts one purge run and the keys it deleted.
    pub fn record_purge(&self, deleted: u64) {
        self.purged_keys.inc_by(deleted);
        self.purge_runs.inc();
    }

    /// The text exposition, with the pool gauges read at scrape time.
    pub fn render(&self, pool: &sqlx::PgPool) -> String {
        let size = i64::from(pool.size());
        let idle = pool.num_idle() as i64;
        self.pool_connections.with_label_values(&["in_use"]).set(size - idle);
        self.pool_connections.with_label_values(&["idle"]).set(idle);
        self.pool_connections
            .with_label_values(&["max"])
            .set(i64::from(pool.options().get_max_connections()));
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding cannot fail");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
