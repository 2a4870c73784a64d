//! Prometheus metrics (docs/operations.md, Metrics), one registry per app so that each instance
//! (and each test's app) counts only its own requests.
//!
//! The alerts in `ops/prometheus/rules.yml` and the dashboard `ops/grafana/oncepay.json`
//! read these series (docs/operations.md); the API test `tests/api/dashboards.rs` fails when
//! one they name is no longer exported.

use std::time::Duration;

use prometheus::core::Collector;
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::db::{Db, DbError, PoolStatus};

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
    /// 422 `idempotency_key_reused` per tenant: a client bug, and whom to call about it.
    pub key_reused_by_tenant: IntCounterVec,
    /// Error answers by problem `code`: tells 503 `temporarily_unavailable` from 429
    /// `overloaded`, which share the outcome `transient_error`.
    pub errors: IntCounterVec,
    pub purged_keys: IntCounter,
    pub purge_runs: IntCounter,
    /// Look-ups of bearers this process did not know as API keys, by outcome: `looked_up`, or
    /// `refused` (429) past their rate (`auth::TenantCache`): a flood of random bearers.
    pub unknown_key_lookups: IntCounterVec,
    pool_connections: IntGaugeVec,
    /// The list pool's connections by state (`Db::for_lists`).
    list_pool_connections: IntGaugeVec,
    /// Requests waiting for a pooled connection right now.
    pub pool_waiting: IntGauge,
    /// List pages that waited while payments kept the database busy
    /// (`AppState::list_conn`).
    pub list_yields: IntCounter,
    /// Replays answered from this process's memory, and keyed requests it had to ask the
    /// database about; entries held.
    pub replay_cache_hits: IntCounter,
    pub replay_cache_misses: IntCounter,
    pub replay_cache_entries: IntGauge,
    /// Payments per statement, and batches that failed as a whole and ran again item by
    /// item (`crate::batch`).
    pub batch: crate::batch::Counters,
    /// Calls to the card processor by call and outcome, and their latency (`crate::top_ups`).
    pub processor: crate::top_ups::processor::CallCounters,
    /// The completer's runs, the operations it drove, and the top-ups left unfinished.
    pub completer: crate::top_ups::CompleterCounters,
    /// The webhook workers' counters and the backlog gauges (`crate::webhooks::delivery`).
    pub webhooks: crate::webhooks::Counters,
    /// The API listener's connections: open, the limit, idle ones closed under pressure
    /// (`crate::http1`).
    pub connections: crate::http1::ConnectionCounters,
    /// 1 when the database answered this scrape's probe (what `/readyz` checks), else 0.
    ready: IntGauge,
    /// Age of the oldest idempotency-key row, next to the retention it must stay under: a
    /// purge that stopped or falls behind shows as the first exceeding the second.
    oldest_key_age: Gauge,
    retention: Gauge,
}

/// Makes a series and registers it in one step. A name or label set prometheus refuses, or
/// a name registered twice, is a mistake in this file: the first test that builds an app
/// finds it.
struct Series<'r>(&'r Registry);

impl Series<'_> {
    fn add<C: Collector + Clone + 'static>(&self, made: prometheus::Result<C>) -> C {
        made.and_then(|series| self.0.register(Box::new(series.clone())).map(|()| series))
            .expect("a valid metric, registered once")
    }

    fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.add(IntCounter::new(name, help))
    }

    fn counters(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.add(IntCounterVec::new(Opts::new(name, help), labels))
    }

    fn gauge(&self, name: &str, help: &str) -> Gauge {
        self.add(Gauge::new(name, help))
    }

    fn int_gauge(&self, name: &str, help: &str) -> IntGauge {
        self.add(IntGauge::new(name, help))
    }

    fn int_gauges(&self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.add(IntGaugeVec::new(Opts::new(name, help), labels))
    }

    fn histogram(&self, name: &str, help: &str, buckets: &[f64]) -> Histogram {
        self.add(Histogram::with_opts(
            HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        ))
    }

    fn histograms(&self, name: &str, help: &str, buckets: &[f64], labels: &[&str]) -> HistogramVec {
        self.add(HistogramVec::new(
            HistogramOpts::new(name, help).buckets(buckets.to_vec()),
            labels,
        ))
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let series = Series(&registry);
        let requests = series.counters(
            "oncepay_requests_total",
            "HTTP requests by route and outcome",
            &["route", "outcome"],
        );
        let duration = series.histograms(
            "oncepay_request_duration_seconds",
            "HTTP request latency by route",
            &[
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
            ],
            &["route"],
        );
        series
            .int_gauges(
                "oncepay_build_info",
                "This process's build (1): its version, the commit it was built from, the newest migration it embeds",
                &["version", "commit", "schema"],
            )
            .with_label_values(&[
                env!("CARGO_PKG_VERSION"),
                crate::BUILD_COMMIT,
                &crate::db::expected_schema_version().to_string(),
            ])
            .set(1);
        let replays_by_tenant = series.counters("oncepay_replays_total", "Replayed answers by tenant", &["tenant"]);
        let keyless_by_tenant = series.counters(
            "oncepay_keyless_requests_total",
            "Keyless requests processed unprotected (policy allow) by tenant",
            &["tenant"],
        );
        let key_reused_by_tenant = series.counters(
            "oncepay_key_reused_total",
            "Requests refused with 422 idempotency_key_reused, by tenant",
            &["tenant"],
        );
        let errors = series.counters("oncepay_errors_total", "Error answers by problem code", &["code"]);
        let purged_keys = series.counter("oncepay_purged_keys_total", "Idempotency-key rows deleted by purges");
        let purge_runs = series.counter("oncepay_purge_runs_total", "Purge runs completed by this process");
        let unknown_key_lookups = series.counters(
            "oncepay_unknown_api_key_lookups_total",
            "Look-ups of bearers this process did not know as API keys: looked_up, or refused (429) past their rate",
            &["outcome"],
        );
        for outcome in ["looked_up", "refused"] {
            unknown_key_lookups.with_label_values(&[outcome]);
        }
        let pool_connections = series.int_gauges(
            "oncepay_db_pool_connections",
            "Database pool connections by state",
            &["state"],
        );
        let list_pool_connections = series.int_gauges(
            "oncepay_db_list_pool_connections",
            "Connections of the pool list pages are read through, by state",
            &["state"],
        );
        let pool_waiting = series.int_gauge("oncepay_db_pool_waiting", "Requests waiting for a database connection");
        let list_yields = series.counter(
            "oncepay_list_yields_total",
            "List pages that waited while payments kept the database busy",
        );
        let replay_cache_hits = series.counter(
            "oncepay_replay_cache_hits_total",
            "Keyed requests answered from this process's replay cache (replays and reused keys)",
        );
        let replay_cache_misses = series.counter(
            "oncepay_replay_cache_misses_total",
            "Keyed requests the replay cache did not know (asked the database)",
        );
        let replay_cache_entries = series.int_gauge(
            "oncepay_replay_cache_entries",
            "Finished results held in this process's replay cache",
        );
        let batch = crate::batch::Counters {
            size: series.histogram(
                "oncepay_db_batch_size",
                "Payments per committed database statement (ONCEPAY_DB_BATCH_MAX)",
                &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
            ),
            split: series.counter(
                "oncepay_db_batches_split_total",
                "Batches of payments that failed as a whole, whose payments then ran one by one",
            ),
            failed: series.counters(
                "oncepay_db_batches_failed_total",
                "Batches of payments that failed as a whole, by what their payments were answered: \
                 split (rolled back for one item; each ran again alone), unknown (the outcome is \
                 unknown; 503, nothing ran again), refused (PostgreSQL refused it for its own state: a timeout, an \
                 overload, a node that cannot write; 503 at once)",
                &["outcome"],
            ),
            held_back: series.counter(
                "oncepay_db_batch_held_back_total",
                "Payments held back from a batch because their account or key was in a statement still out",
            ),
            held_for_share: series.counter(
                "oncepay_db_batch_held_for_share_total",
                "Payments held back from a batch because their tenant had its share (ONCEPAY_DB_TENANT_SHARE) \
                 in statements while other tenants were paying",
            ),
            limit: series.int_gauge(
                "oncepay_db_batches_in_flight_limit",
                "Batch statements this process may have in flight now: chosen from their latency \
                 (src/batch/limit.rs), or ONCEPAY_DB_BATCHES_IN_FLIGHT when set",
            ),
            limit_changes: series.counters(
                "oncepay_db_batches_in_flight_limit_changes_total",
                "Changes of the limit on batch statements in flight, by direction: up (statements \
                 came back near their least latency while payments waited), down (latency grew)",
                &["direction"],
            ),
            least_latency: series.gauge(
                "oncepay_db_batch_least_latency_seconds",
                "The least latency seen for a batch statement of one payment: the baseline the limit \
                 on statements in flight is judged against",
            ),
        };
        for direction in ["up", "down"] {
            batch.limit_changes.with_label_values(&[direction]);
        }
        let processor = crate::top_ups::processor::CallCounters {
            calls: series.counters(
                "oncepay_processor_calls_total",
                "Calls to the card processor by call and outcome: ok, declined (402), refused (another 4xx), \
                 replayed (a 5xx the processor answered again under the call's key), \
                 unknown (timeout, connection failure, 5xx: the call may or may not have taken effect)",
                &["call", "outcome"],
            ),
            duration: series.histograms(
                "oncepay_processor_call_duration_seconds",
                "Card processor call latency by call",
                &[0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0],
                &["call"],
            ),
        };
        let completer = crate::top_ups::CompleterCounters {
            runs: series.counters(
                "oncepay_completer_runs_total",
                "Completer rounds of this process by outcome (ok, error)",
                &["outcome"],
            ),
            operations: series.counters(
                "oncepay_completer_operations_total",
                "Top-ups and refunds the completer drove, by result: finished, waiting (at the processor, \
                 looked at again later), unknown (left for a later round)",
                &["result"],
            ),
            unfinished: series.int_gauge(
                "oncepay_top_ups_unfinished",
                "Top-ups and refunds waiting for the processor (all tenants), as of the last completer round",
            ),
            oldest_unfinished: series.int_gauge(
                "oncepay_top_up_oldest_unfinished_seconds",
                "How long the oldest unfinished top-up (since its creation) or refund (since its debit) has \
                 waited, all tenants, as of the last completer round; 0 when none",
            ),
        };
        let webhooks = crate::webhooks::Counters {
            deliveries: series.counters(
                "oncepay_webhook_deliveries_total",
                "Webhook attempts by outcome: delivered (2xx), retry (failed, attempted again later), \
                 given_up (failed the whole retry schedule: that message alone), gone (410: endpoint \
                 disabled), deferred (this replica could not attempt it, e.g. a secret it cannot \
                 decrypt: not counted against the receiver), unrecorded (the result could not be \
                 written; sent again after its lease)",
                &["outcome"],
            ),
            endpoints_disabled: series.counters(
                "oncepay_webhook_endpoints_disabled_total",
                "Webhook endpoints this process disabled, by reason: gone (410), failing (no attempt \
                 succeeded for ONCEPAY_WEBHOOK_DISABLE_AFTER_SECS while attempts kept failing)",
                &["reason"],
            ),
            attempt_duration: series.histogram(
                "oncepay_webhook_attempt_duration_seconds",
                "Duration of one webhook attempt",
                &[0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0],
            ),
            pending: series.int_gauges(
                "oncepay_webhook_pending_deliveries",
                "Webhook deliveries not yet delivered (every replica's, read from the database), by their age",
                &["age"],
            ),
            oldest_pending: series.gauge(
                "oncepay_webhook_oldest_pending_seconds",
                "Age of the oldest webhook delivery not yet delivered or given up (0 when there is none)",
            ),
            disabled_now: series.int_gauge(
                "oncepay_webhook_endpoints_disabled",
                "Webhook endpoints disabled now (410 Gone, or failing for ONCEPAY_WEBHOOK_DISABLE_AFTER_SECS), not deleted",
            ),
            held: series.int_gauge(
                "oncepay_webhook_held_deliveries",
                &format!(
                    "Webhook deliveries kept for disabled endpoints until they are enabled (every replica's, counted up to {})",
                    crate::webhooks::delivery::HELD_COUNTED_UP_TO
                ),
            ),
        };
        // Every label value exported from the start (at 0), so that alerts and dashboards see
        // the series before the first event.
        for outcome in ["delivered", "retry", "given_up", "gone", "deferred", "unrecorded"] {
            webhooks.deliveries.with_label_values(&[outcome]);
        }
        for reason in ["gone", "failing"] {
            webhooks.endpoints_disabled.with_label_values(&[reason]);
        }
        for age in ["lt_1m", "1m_to_1h", "gt_1h"] {
            webhooks.pending.with_label_values(&[age]);
        }
        let connections = crate::http1::ConnectionCounters {
            open: series.int_gauge(
                "oncepay_connections_open",
                "Connections open on the API listener of this process",
            ),
            max: series.int_gauge(
                "oncepay_connections_max",
                "Open connections this process serves at most (ONCEPAY_MAX_CONNECTIONS); past 80 % of it \
                 idle keep-alive connections are closed first",
            ),
            idle_closed: series.counter(
                "oncepay_connections_idle_closed_total",
                "Idle keep-alive connections closed because open connections passed 80 % of \
                 ONCEPAY_MAX_CONNECTIONS",
            ),
            refused: series.counters(
                "oncepay_connections_refused_total",
                "Connections refused at accept, by reason: per_peer (the peer address had \
                 ONCEPAY_MAX_CONNECTIONS_PER_PEER open already)",
                &["reason"],
            ),
            rejected: series.counters(
                "oncepay_requests_rejected_total",
                "Requests the HTTP layer answered itself before any route, by problem code: invalid_request \
                 (400, a head it cannot parse), headers_too_large (431), request_timeout (408, a head that did \
                 not arrive within 5 s)",
                &["code"],
            ),
        };
        connections.refused.with_label_values(&["per_peer"]);
        for code in ["invalid_request", "headers_too_large", "request_timeout"] {
            connections.rejected.with_label_values(&[code]);
        }
        let ready = series.int_gauge(
            "oncepay_ready",
            "1 when a writable primary answered the scrape's probe (as /readyz), else 0 (also while serve \
             has not reached it since it started, and once it got SIGTERM)",
        );
        let oldest_key_age = series.gauge(
            "oncepay_idempotency_key_oldest_age_seconds",
            "Age of the oldest idempotency-key row (0 when there is none)",
        );
        let retention = series.gauge(
            "oncepay_idempotency_key_retention_seconds",
            "How long a key row is kept before purge (ONCEPAY_RETENTION_SECS)",
        );
        Self {
            registry,
            requests,
            duration,
            replays_by_tenant,
            keyless_by_tenant,
            key_reused_by_tenant,
            errors,
            purged_keys,
            purge_runs,
            unknown_key_lookups,
            pool_connections,
            list_pool_connections,
            pool_waiting,
            list_yields,
            replay_cache_hits,
            replay_cache_misses,
            replay_cache_entries,
            batch,
            processor,
            completer,
            webhooks,
            connections,
            ready,
            oldest_key_age,
            retention,
        }
    }

    /// Exports the connection pool's own counters with this process's metrics.
    pub fn register_db(&self, db: &Db) {
        self.registry
            .register(Box::new(db.connections_closed().clone()))
            .expect("a process registers its pool once");
    }

    /// `serve`'s start-up check reached the database: `oncepay_ready` is 1 until a scrape's
    /// probe finds otherwise (a scrape while the pool is busy keeps it).
    pub fn record_database_reached(&self) {
        self.ready.set(1);
    }

    /// Counts one purge run and the keys it deleted.
    pub fn record_purge(&self, deleted: u64) {
        self.purged_keys.inc_by(deleted);
        self.purge_runs.inc();
    }

    /// The text exposition, with the pools' and the database's gauges read at scrape time
    /// (`db` the main pool, `lists` the list pools' added up). Before `serve` has reached the
    /// database, and once it got SIGTERM (`started` false), nothing is asked of it: the scrape
    /// answers at once, with `oncepay_ready` 0.
    pub async fn render(&self, db: &Db, lists: PoolStatus, retention: Duration, started: bool) -> String {
        if started {
            self.probe_database(db).await;
        } else {
            self.ready.set(0);
        }
        self.retention.set(retention.as_secs_f64());
        for (gauges, pool) in [
            (&self.pool_connections, db.status()),
            (&self.list_pool_connections, lists),
        ] {
            let gauge = |label: &str, n: usize| {
                gauges
                    .with_label_values(&[label])
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            };
            gauge("in_use", pool.size - pool.idle);
            gauge("idle", pool.idle);
            gauge("max", pool.max);
        }
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding cannot fail");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

impl Metrics {
    /// Whether the database is ready, as `/readyz` asks it ([`crate::db::writable`]), then how
    /// far behind the purge is (the minimum of the key table's `created_at` index), both within
    /// [`crate::db::PROBE_WITHIN`]. The key age keeps its last value when it cannot be read: a
    /// lock on the key table is not a database that is down.
    ///
    /// A pool whose every connection is in use is busy, not cut off (those connections are
    /// answering, or failing and being closed): the probe is skipped rather than holding the
    /// scrape for a connection, and both gauges keep the last probe's values.
    async fn probe_database(&self, db: &Db) {
        let pool = db.status();
        if pool.idle == 0 && pool.size >= pool.max {
            return;
        }
        let deadline = tokio::time::Instant::now() + crate::db::PROBE_WITHIN;
        let writable =
            tokio::time::timeout_at(deadline, async { crate::db::writable(&mut db.conn().await?).await }).await;
        match writable {
            Ok(Ok(true)) => self.ready.set(1),
            Ok(Err(DbError::Saturated)) => return,
            // A database that holds the query (PgBouncer's PAUSE) is not ready, as `/readyz`
            // says; nor is one that answers as a standby or read-only.
            Ok(Ok(false) | Err(_)) | Err(_) => {
                self.ready.set(0);
                return;
            }
        }
        let age = tokio::time::timeout_at(
            deadline,
            db.run(async |conn| {
                sqlx::query_scalar::<_, Option<f64>>(
                    "SELECT extract(epoch FROM now() - min(created_at))::float8 FROM idempotency_keys",
                )
                .fetch_one(conn)
                .await
            }),
        )
        .await;
        if let Ok(Ok(age)) = age {
            self.oldest_key_age.set(age.unwrap_or(0.0).max(0.0));
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
