//! The delivery workers: every replica runs one [`Deliverer`], and they share the work
//! through PostgreSQL alone (no second queue).
//!
//! A change's transaction writes only its event; a claim first writes the deliveries of the
//! events committed since (the fan-out, at most every [`FAN_OUT_EVERY`] per worker, one at a
//! time over all replicas, in event order: migrations/V14, V16). A worker claims due
//! deliveries with `oncepay_webhook_claim` (migrations/V9, V11, V14, V16): by state,
//! `FOR UPDATE SKIP LOCKED`, at most `ONCEPAY_WEBHOOK_ENDPOINT_CONCURRENCY` in flight per
//! endpoint over all replicas, the next event of a resource only after the previous one was
//! delivered or given up. The claim leases the row (its next attempt moves past the HTTP
//! timeout), then the attempt runs with no connection or lock held, then its result is
//! recorded ([`record_results`], every attempt that ended since the worker's last round trip
//! at once, migrations/V22): a 2xx is a delivery (the status decides: the body is read only up
//! to the head kept, within [`HEAD_READ`]); 410 Gone disables the endpoint; anything else
//! (another status, a timeout, a connection refused or cut before the answer) is retried after
//! the next wait of `ONCEPAY_WEBHOOK_RETRY_SCHEDULE` (±10 % jitter; at least `Retry-After` on
//! 429 and 503), and after the last that message alone is given up. The endpoint is disabled
//! only when none of its attempts succeeded for `ONCEPAY_WEBHOOK_DISABLE_AFTER_SECS` while they
//! kept failing; its events are then kept until it is enabled again. What fails on this
//! replica's side (a secret it cannot decrypt) is deferred, not counted against the receiver.
//! A replica that dies mid-attempt leaves its lease to run out; another replica then sends the
//! same event again, with the same `webhook-id`: delivery is at least once, and receivers
//! deduplicate by that id (docs/webhooks.md).
//!
//! Fair shares: a worker gives each tenant with attempts in flight at most
//! `ONCEPAY_WEBHOOK_CONCURRENCY / (tenants in flight + 1)` of its slots, so that one tenant's
//! slow endpoints never hold every slot while another tenant's deliveries wait: there is
//! always a share free for a tenant that has none in flight.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use prometheus::{Gauge, Histogram, IntCounterVec, IntGauge, IntGaugeVec};
use rand::Rng as _;
use reqwest::header::{HeaderMap, CONTENT_TYPE, RETRY_AFTER};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::secrets::SecretBox;
use super::{endpoints, signing, target};
use crate::config::WebhookSettings;
use crate::db::{Db, DbError};
use crate::throttle::Throttle;

/// Bytes of an answer kept with its attempt.
const RESPONSE_HEAD_BYTES: usize = 256;
/// The longest an attempt reads an answer's body, once its status has arrived: a receiver
/// that sends its status and then stalls has answered.
pub const HEAD_READ: Duration = Duration::from_secs(1);
/// When a delivery this replica could not attempt (a secret it cannot decrypt) is due again:
/// another replica may take it meanwhile.
const DEFER: Duration = Duration::from_secs(5);
/// The ERROR line of a delivery this replica cannot sign is written at most this often, with
/// the number of others deferred since: a replica without the right key defers every due
/// delivery every [`DEFER`], and a line each buried its log (a few endpoints: a line a second).
const CANNOT_SIGN_LOG_EVERY: Duration = Duration::from_secs(60);
/// Most deliveries one claim takes.
const CLAIM_MAX: usize = 64;
/// A lease outlives the attempt's timeout by this much (the result's recording included).
const LEASE_MARGIN: Duration = Duration::from_secs(10);
/// How long a worker waits, after the first attempt that ended, for others to end with it.
const GATHER: Duration = Duration::from_millis(2);
/// The wait before recording again when the database could not be reached.
const RECORD_RETRY: Duration = Duration::from_millis(500);
/// How often a worker writes the deliveries of newly committed events (the fan-out) before
/// a claim: each fan-out steps over the index entries of the events fanned out since the
/// table's last vacuum, so one per claim (hundreds a second) cost more than the claims
/// (migrations/V16). An event waits for its deliveries at most this much longer.
const FAN_OUT_EVERY: Duration = Duration::from_millis(20);

/// What the workers count, registered by the caller (`crate::metrics`).
#[derive(Clone)]
pub struct Counters {
    /// `oncepay_webhook_deliveries_total{outcome}`: delivered, retry, given_up, gone.
    pub deliveries: IntCounterVec,
    /// `oncepay_webhook_endpoints_disabled_total{reason}`: gone (410), failing (no attempt
    /// succeeded for the disable-after while attempts kept failing).
    pub endpoints_disabled: IntCounterVec,
    /// `oncepay_webhook_attempt_duration_seconds`.
    pub attempt_duration: Histogram,
    /// `oncepay_webhook_pending_deliveries{age}`: the backlog (all replicas: read from the
    /// database), by the age of its event: `lt_1m`, `1m_to_1h`, `gt_1h`. An event not yet
    /// fanned out to its endpoints counts once (migrations/V14).
    pub pending: IntGaugeVec,
    /// `oncepay_webhook_oldest_pending_seconds`: the age of the oldest undelivered event
    /// (0 with none): what the alert watches.
    pub oldest_pending: Gauge,
    /// `oncepay_webhook_endpoints_disabled`: endpoints disabled now (not deleted).
    pub disabled_now: IntGauge,
    /// `oncepay_webhook_held_deliveries`: deliveries kept for disabled endpoints until they
    /// are enabled, counted up to [`HELD_COUNTED_UP_TO`].
    pub held: IntGauge,
}

/// The most held deliveries the gauge counts (each refresh reads them from an index): a
/// backlog past it reads as this many.
pub const HELD_COUNTED_UP_TO: i64 = 100_000;

/// One claimed delivery.
#[derive(Debug)]
struct Claimed {
    tenant: Uuid,
    event: Uuid,
    endpoint: Uuid,
    attempt: i32,
    /// Its place in the retry schedule: the attempt number since the delivery was last
    /// reopened (resend, recover, enable: migrations/V24), 1 for the first.
    schedule_attempt: i32,
    url: String,
    secret: Vec<u8>,
    previous_secret: Option<Vec<u8>>,
    event_type: String,
    data: serde_json::Value,
    created_at: DateTime<Utc>,
}

/// What one attempt came to.
#[derive(Debug, PartialEq)]
enum Verdict {
    Delivered,
    Gone,
    Failed {
        retry_after: Option<Duration>,
    },
    /// This replica could not make the attempt (its own failure, not the receiver's).
    Deferred,
}

/// What a recorded attempt does to its delivery (`oncepay_webhook_record_results`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A 2xx.
    Delivered,
    /// Failed; attempted again at this time.
    Retry(DateTime<Utc>),
    /// Failed, the schedule spent: this message is given up.
    GivenUp,
    /// 410 Gone: the endpoint is disabled.
    Gone,
    /// Not attempted by this replica: due again at this time, the attempt given back.
    Deferred(DateTime<Utc>),
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Delivered => "delivered",
            Self::Retry(_) => "retry",
            Self::GivenUp => "given_up",
            Self::Gone => "gone",
            Self::Deferred(_) => "deferred",
        }
    }

    fn next_attempt_at(self) -> Option<DateTime<Utc>> {
        match self {
            Self::Retry(at) | Self::Deferred(at) => Some(at),
            _ => None,
        }
    }
}

/// One attempt, as recorded.
#[derive(Clone, Debug)]
pub struct AttemptResult {
    pub tenant: Uuid,
    pub event: Uuid,
    pub endpoint: Uuid,
    /// Its number (1-based), as the claim counted it.
    pub attempt: i32,
    pub started_at: DateTime<Utc>,
    pub latency: Duration,
    pub status: Option<u16>,
    /// The answer's first bytes, as [`readable_head`] writes them.
    pub head: Option<String>,
    pub error: Option<String>,
    pub outcome: Outcome,
}

/// An attempt as made.
struct Attempt {
    started_at: DateTime<Utc>,
    latency: Duration,
    status: Option<u16>,
    head: Option<String>,
    error: Option<String>,
    verdict: Verdict,
}

/// An attempt that ended, to be recorded.
struct Ended {
    result: AttemptResult,
    /// Past this its lease may have run out: the result is dropped if still unrecorded.
    record_by: Instant,
}

/// The deliverer's own connections: it makes one round trip at a time (a record, then a
/// claim) and refreshes its gauges beside it.
///
/// Its own, not the server's pool: a connection's socket is served by the reactor of the
/// Tokio runtime that opened it, and the server's pool also holds connections that the HTTP
/// workers opened, each on its own runtime. At a graceful stop those runtimes end with the
/// HTTP drain, while the deliverer still records the attempts in flight: a record on such a
/// connection was sent, committed, and its answer never read ("outcome unknown ... A Tokio
/// 1.x context was found, but it is being shutdown", a WARN that the attempts would be
/// recorded again; found from outside, 2026-12-07). These are opened by the deliverer, on the
/// main runtime, which runs until the process ends.
pub const DELIVERER_CONNECTIONS: usize = 2;

pub struct Deliverer {
    /// [`DELIVERER_CONNECTIONS`] of its own.
    db: Db,
    sealer: Arc<SecretBox>,
    http: reqwest::Client,
    settings: WebhookSettings,
    replica: String,
    counters: Counters,
    cannot_sign: Throttle,
    /// A claim that failed (the database away): one WARN line every 10 s, not every round.
    claim_failed: Throttle,
}

impl Deliverer {
    pub fn new(db: Db, sealer: Arc<SecretBox>, settings: WebhookSettings, counters: Counters) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .dns_resolver(Arc::new(target::GuardedResolver {
                allow_private: settings.allow_private,
            }))
            // A proxy would resolve the name itself, past the resolver's guard.
            .no_proxy()
            .timeout(settings.timeout)
            .connect_timeout(settings.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(settings.endpoint_concurrency as usize)
            .user_agent(concat!("oncepay-webhooks/", env!("CARGO_PKG_VERSION")))
            .build()?;
        // Names the replica in each attempt's row: host, process, and this worker.
        let replica = format!(
            "{}:{}:{}",
            std::env::var("HOSTNAME").unwrap_or_else(|_| "oncepay".to_owned()),
            std::process::id(),
            &Uuid::new_v4().simple().to_string()[..8]
        );
        Ok(Self {
            db,
            sealer,
            http,
            settings,
            replica,
            counters,
            cannot_sign: Throttle::new(CANNOT_SIGN_LOG_EVERY),
            claim_failed: Throttle::new(Duration::from_secs(10)),
        })
    }

    /// Closes the deliverer's connections, once it has stopped.
    pub async fn close(&self) {
        self.db.close().await;
    }

    /// Runs the worker until `stop` is cancelled (then [`Self::drain`]s it) or the task is
    /// dropped. One round trip at a time, in a loop: the attempts that ended since the last
    /// are recorded together, then as many due deliveries are claimed as attempts may start.
    /// It claims again at once when it took all it asked for (more may be due), and otherwise
    /// waits for an attempt to end or for `ONCEPAY_WEBHOOK_POLL_MS`, whichever comes first: an
    /// endpoint at its bound gets its next delivery as soon as one of its attempts ends, not a
    /// poll later.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let slots = Arc::new(Semaphore::new(self.settings.concurrency));
        let (ended_tx, mut ended_rx) = mpsc::unbounded_channel::<Ended>();
        let gauges = tokio::spawn(self.clone().refresh_gauges());
        let _stop_gauges = AbortOnDrop(gauges);
        let mut ended = Vec::new();
        let mut shares = Shares::default();
        let mut fanned_out: Option<Instant> = None;
        loop {
            while let Ok(e) = ended_rx.try_recv() {
                shares.ended(e.result.tenant, e.result.endpoint);
                ended.push(e);
            }
            if !ended.is_empty() && !self.record(&mut ended).await {
                tokio::time::sleep(RECORD_RETRY).await;
                continue;
            }
            if stop.is_cancelled() {
                return self.drain(&slots, ended_rx, ended).await;
            }
            let free = slots.available_permits().min(CLAIM_MAX);
            let mut more_due = false;
            if free > 0 {
                let fan_out = fanned_out.is_none_or(|t| t.elapsed() >= FAN_OUT_EVERY);
                if fan_out {
                    fanned_out = Some(Instant::now());
                }
                match self
                    .claim(free, fan_out, &shares.rooms(self.settings.concurrency))
                    .await
                {
                    Ok(claimed) => {
                        more_due = claimed.len() == free;
                        for c in claimed {
                            let Ok(permit) = slots.clone().acquire_owned().await else {
                                return;
                            };
                            shares.started(c.tenant, c.endpoint);
                            let (this, tx) = (self.clone(), ended_tx.clone());
                            tokio::spawn(async move {
                                let e = this.deliver(c).await;
                                // Only fails once the worker is gone: the lease then runs out.
                                let _ = tx.send(e);
                                // After the result is sent: a drain that sees every permit
                                // back has every result in its channel.
                                drop(permit);
                            });
                        }
                    }
                    Err(err) => {
                        match self.claim_failed.admit(Instant::now()) {
                            Some(held_back) => tracing::warn!(error = %err, failures_since_last_line = held_back,
                                "webhook claim failed; will try again"),
                            None => tracing::debug!(error = %err, "webhook claim failed; will try again"),
                        }
                        tokio::time::sleep(self.settings.poll.max(Duration::from_secs(1))).await;
                        continue;
                    }
                }
            }
            if !more_due {
                let waited = tokio::select! {
                    waited = tokio::time::timeout(self.settings.poll, ended_rx.recv()) => waited,
                    () = stop.cancelled() => continue,
                };
                if let Ok(Some(e)) = waited {
                    shares.ended(e.result.tenant, e.result.endpoint);
                    ended.push(e);
                    // Attempts still in flight tend to end together: a moment's wait lets one
                    // round trip record and replace several (measured: ~6 per round trip
                    // without it, at a fixed cost per round trip larger than per attempt).
                    if slots.available_permits() < self.settings.concurrency {
                        tokio::time::sleep(GATHER).await;
                    }
                }
            }
        }
    }

    /// The worker's end on a graceful stop: nothing more is claimed, the attempts in flight
    /// end (each within the attempt timeout and its head's read) and are recorded, so that a
    /// replica stopped in a rolling restart neither loses their answers nor has them sent
    /// again a lease later. Bounded: what has not ended by then, or a database that refuses
    /// the record three times, is left to the leases, as after a crash.
    async fn drain(&self, slots: &Semaphore, mut ended_rx: mpsc::UnboundedReceiver<Ended>, mut ended: Vec<Ended>) {
        let deadline = tokio::time::Instant::now() + self.settings.timeout + HEAD_READ;
        let in_flight = self.settings.concurrency - slots.available_permits();
        tracing::info!(
            in_flight,
            "webhook deliverer stopping: recording the attempts in flight"
        );
        while slots.available_permits() < self.settings.concurrency {
            match tokio::time::timeout_at(deadline, ended_rx.recv()).await {
                Ok(Some(e)) => ended.push(e),
                _ => break,
            }
        }
        while let Ok(e) = ended_rx.try_recv() {
            ended.push(e);
        }
        for _ in 0..3 {
            if ended.is_empty() || self.record(&mut ended).await {
                break;
            }
            tokio::time::sleep(RECORD_RETRY).await;
        }
        let left = self.settings.concurrency - slots.available_permits();
        if left > 0 || !ended.is_empty() {
            tracing::warn!(
                in_flight = left,
                unrecorded = ended.len(),
                "webhook deliverer stopped with attempts unrecorded; their leases will run out"
            );
        }
    }

    /// Claims up to `n` due deliveries, each tenant within its room, first writing those of
    /// newly committed events if `fan_out`.
    async fn claim(&self, n: usize, fan_out: bool, rooms: &Rooms) -> Result<Vec<Claimed>, DbError> {
        // The lease covers the attempt, its head's read and the recording.
        let lease = self.settings.timeout + HEAD_READ + LEASE_MARGIN;
        let lease_ms = i32::try_from(lease.as_millis()).unwrap_or(i32::MAX);
        let per_endpoint = i32::try_from(self.settings.endpoint_concurrency).unwrap_or(i32::MAX);
        let limit = i32::try_from(n).unwrap_or(i32::MAX);
        let rows = self
            .db
            .run(async |c| {
                sqlx::query!(
                    r#"SELECT tenant_id AS "tenant_id!", event_id AS "event_id!", endpoint_id AS "endpoint_id!",
                              attempt AS "attempt!", url AS "url!", secret_encrypted AS "secret_encrypted!",
                              previous_secret_encrypted, event_type AS "event_type!", data AS "data!",
                              created_at AS "created_at!", schedule_attempt AS "schedule_attempt!"
                         FROM oncepay_webhook_claim_scheduled($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"#,
                    limit,
                    per_endpoint,
                    lease_ms,
                    fan_out,
                    &rooms.tenants,
                    &rooms.rooms,
                    rooms.others,
                    &rooms.shares,
                    &rooms.busy,
                    &rooms.endpoints,
                    &rooms.endpoint_in_flight,
                )
                .fetch_all(c)
                .await
            })
            .await?;
        Ok(rows
            .into_iter()
            .map(|r| Claimed {
                tenant: r.tenant_id,
                event: r.event_id,
                endpoint: r.endpoint_id,
                attempt: r.attempt,
                schedule_attempt: r.schedule_attempt,
                url: r.url,
                secret: r.secret_encrypted,
                previous_secret: r.previous_secret_encrypted,
                event_type: r.event_type,
                data: r.data,
                created_at: r.created_at,
            })
            .collect())
    }

    /// One attempt of one delivery, and what is to be recorded of it.
    async fn deliver(&self, c: Claimed) -> Ended {
        let attempt = self.attempt(&c).await;
        self.counters.attempt_duration.observe(attempt.latency.as_secs_f64());
        let after = |wait: Duration| Utc::now() + chrono::Duration::from_std(wait).unwrap_or(chrono::Duration::MAX);
        let outcome = match &attempt.verdict {
            Verdict::Delivered => Outcome::Delivered,
            Verdict::Gone => Outcome::Gone,
            Verdict::Deferred => Outcome::Deferred(after(DEFER)),
            Verdict::Failed { retry_after } => {
                match next_wait(&self.settings.retry_schedule, c.schedule_attempt, *retry_after) {
                    Some(wait) => Outcome::Retry(after(wait)),
                    None => Outcome::GivenUp,
                }
            }
        };
        tracing::info!(
            event = %c.event, endpoint = %c.endpoint, attempt = c.attempt, outcome = outcome.as_str(),
            status = attempt.status, error = attempt.error.as_deref(),
            latency_ms = attempt.latency.as_millis() as u64, "webhook attempt"
        );
        Ended {
            record_by: Instant::now() + LEASE_MARGIN,
            result: AttemptResult {
                tenant: c.tenant,
                event: c.event,
                endpoint: c.endpoint,
                attempt: c.attempt,
                started_at: attempt.started_at,
                latency: attempt.latency,
                status: attempt.status,
                head: attempt.head,
                error: attempt.error,
                outcome,
            },
        }
    }

    async fn attempt(&self, c: &Claimed) -> Attempt {
        let started_at = Utc::now();
        let clock = Instant::now();
        let failed = |error: String, verdict: Verdict| Attempt {
            started_at,
            latency: clock.elapsed(),
            status: None,
            head: None,
            error: Some(error),
            verdict,
        };
        let keys = match self.keys(c) {
            Ok(keys) => keys,
            Err(err) => {
                // This replica's own failure (its ONCEPAY_WEBHOOK_SECRET_KEY is not the one the
                // secret was sealed with, or it has none): nothing was sent, nothing counts
                // against the receiver; a replica with the right key takes it. Each is counted
                // (`outcome="deferred"`); the line is written once a minute.
                match self.cannot_sign.admit(Instant::now()) {
                    Some(held_back) => tracing::error!(endpoint = %c.endpoint, tenant = %c.tenant, error = %err,
                        deferred_since_last_line = held_back,
                        "this replica cannot sign for a webhook endpoint (check ONCEPAY_WEBHOOK_SECRET_KEY); delivery deferred"),
                    None => tracing::debug!(endpoint = %c.endpoint, tenant = %c.tenant, error = %err,
                        "this replica cannot sign for a webhook endpoint; delivery deferred"),
                }
                return failed(err.to_string(), Verdict::Deferred);
            }
        };
        let url = match target::parse(&c.url) {
            Ok(url) => url,
            Err(err) => return failed(err.to_string(), Verdict::Failed { retry_after: None }),
        };
        // A literal address is not resolved, so the resolver's guard does not see it.
        if let Some(ip) = url
            .host_str()
            .and_then(|h| h.trim_start_matches('[').trim_end_matches(']').parse().ok())
        {
            if !self.settings.allow_private && !target::is_global(ip) {
                return failed(
                    target::Refused::Private(ip).to_string(),
                    Verdict::Failed { retry_after: None },
                );
            }
        }
        let id = c.event.to_string();
        let timestamp = Utc::now().timestamp();
        let body = endpoints::body(&c.event_type, c.created_at, &c.data);
        let signature = signing::header(&keys, &id, timestamp, &body);
        let request = self
            .http
            .post(url)
            .header(CONTENT_TYPE, "application/json")
            .header("webhook-id", &id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(body);
        // The status decides; the body is read only for the head kept, and only briefly: a
        // receiver that answered 2xx and then stalls (or sends a body without end) has answered.
        // Both the client's timers (the connection's and the request's) and ours run the
        // attempt's timeout; whichever fires first, the attempt is listed in the same words.
        let timeout = self.settings.timeout.as_millis();
        let sent = tokio::time::timeout(self.settings.timeout, request.send()).await;
        let mut response = match sent {
            Ok(Ok(response)) => response,
            Ok(Err(err)) if !err.is_timeout() => {
                return failed(error_chain(&err), Verdict::Failed { retry_after: None })
            }
            Ok(Err(_)) | Err(_) => {
                return failed(
                    format!("no answer within {timeout} ms"),
                    Verdict::Failed { retry_after: None },
                )
            }
        };
        let status = response.status();
        let mut head = Vec::new();
        let _ = tokio::time::timeout(HEAD_READ, async {
            while head.len() < RESPONSE_HEAD_BYTES {
                match response.chunk().await {
                    Ok(Some(chunk)) => head.extend_from_slice(&chunk),
                    // A body cut short after the status is still an answer.
                    Ok(None) | Err(_) => break,
                }
            }
        })
        .await;
        head.truncate(RESPONSE_HEAD_BYTES);
        let verdict = if status.is_success() {
            Verdict::Delivered
        } else if status.as_u16() == 410 {
            Verdict::Gone
        } else {
            let retry_after = matches!(status.as_u16(), 429 | 503)
                .then(|| retry_after(response.headers()))
                .flatten();
            Verdict::Failed { retry_after }
        };
        Attempt {
            started_at,
            latency: clock.elapsed(),
            status: Some(status.as_u16()),
            head: Some(readable_head(&head)),
            error: None,
            verdict,
        }
    }

    /// The signing keys: the current secret's, and the previous one's during a rotation.
    fn keys(&self, c: &Claimed) -> anyhow::Result<Vec<Vec<u8>>> {
        let mut keys = Vec::with_capacity(2);
        for stored in std::iter::once(&c.secret).chain(c.previous_secret.as_ref()) {
            let secret = self.sealer.open(c.tenant, stored)?;
            keys.push(
                signing::key_of(&secret).ok_or_else(|| anyhow::anyhow!("a stored secret is not a whsec_ secret"))?,
            );
        }
        Ok(keys)
    }

    /// Records the ended attempts and empties `ended`; `false` if the database could not be
    /// reached, with the attempts still to be recorded left in `ended` (for about as long as
    /// their leases last: after that another replica may already have sent the event again,
    /// so the stale result is dropped and counted).
    async fn record(&self, ended: &mut Vec<Ended>) -> bool {
        let results: Vec<AttemptResult> = ended.iter().map(|e| e.result.clone()).collect();
        match record_results(&self.db, &self.replica, Health::of(&self.settings), &results).await {
            Ok(recorded) => {
                for (tenant, endpoint) in &recorded.disabled_for_failing {
                    self.counters.endpoints_disabled.with_label_values(&["failing"]).inc();
                    tracing::warn!(endpoint = %endpoint, tenant = %tenant, reason = "failing",
                        "webhook endpoint disabled");
                }
                for ((e, applied), gave_up) in ended.drain(..).zip(recorded.applied).zip(recorded.gave_up) {
                    // A give-up that a recovery voided while the attempt was out goes again
                    // now: a retry.
                    let outcome = match e.result.outcome {
                        Outcome::GivenUp if applied == Some(true) && !gave_up => "retry",
                        outcome => outcome.as_str(),
                    };
                    self.counters.deliveries.with_label_values(&[outcome]).inc();
                    if applied == Some(true) && e.result.outcome == Outcome::Gone {
                        self.counters.endpoints_disabled.with_label_values(&["gone"]).inc();
                        tracing::warn!(endpoint = %e.result.endpoint, tenant = %e.result.tenant, reason = "gone",
                            "webhook endpoint disabled");
                    }
                    if applied.is_none() {
                        self.counters.deliveries.with_label_values(&["unrecorded"]).inc();
                    }
                }
                true
            }
            Err(err) => {
                let retry = matches!(err, DbError::Transient(_) | DbError::Unknown(_) | DbError::Saturated);
                let now = Instant::now();
                let before = ended.len();
                ended.retain(|e| retry && e.record_by > now);
                let dropped = before - ended.len();
                if dropped > 0 {
                    // The leases run out and the deliveries are attempted again (same webhook-id).
                    self.counters
                        .deliveries
                        .with_label_values(&["unrecorded"])
                        .inc_by(dropped as u64);
                    tracing::error!(error = %err, attempts = dropped,
                        "webhook attempts could not be recorded; they will be sent again after their leases");
                } else {
                    tracing::warn!(error = %err, attempts = ended.len(), "webhook attempts not recorded yet; will try again");
                }
                ended.is_empty()
            }
        }
    }

    /// The backlog gauges, every few seconds (one query over the pending deliveries), less
    /// often the longer a read takes ([`gauges_pause`]).
    async fn refresh_gauges(self: Arc<Self>) {
        loop {
            let started = Instant::now();
            let read = self
                .db
                .run(async |c| {
                    sqlx::query!(
                        r#"WITH waiting AS (
                               SELECT d.created_at FROM webhook_deliveries d WHERE d.state = 'pending'
                               UNION ALL
                               SELECT ev.created_at FROM webhook_events ev WHERE ev.awaiting_fan_out)
                           SELECT count(*) FILTER (WHERE w.created_at > now() - interval '1 minute') AS "fresh!",
                                  count(*) FILTER (WHERE w.created_at <= now() - interval '1 minute'
                                                     AND w.created_at > now() - interval '1 hour') AS "recent!",
                                  count(*) FILTER (WHERE w.created_at <= now() - interval '1 hour') AS "old!",
                                  coalesce(extract(epoch FROM now() - min(w.created_at))::float8, 0) AS "oldest!",
                                  (SELECT count(*) FROM webhook_endpoints e
                                    WHERE e.disabled_at IS NOT NULL AND e.deleted_at IS NULL) AS "disabled!",
                                  (SELECT count(*) FROM (SELECT FROM webhook_deliveries d WHERE d.state = 'held'
                                                          LIMIT $1) held) AS "held!"
                             FROM waiting w"#,
                        HELD_COUNTED_UP_TO
                    )
                    .fetch_one(c)
                    .await
                })
                .await;
            match read {
                Ok(r) => {
                    self.counters.pending.with_label_values(&["lt_1m"]).set(r.fresh);
                    self.counters.pending.with_label_values(&["1m_to_1h"]).set(r.recent);
                    self.counters.pending.with_label_values(&["gt_1h"]).set(r.old);
                    self.counters.oldest_pending.set(r.oldest);
                    self.counters.disabled_now.set(r.disabled);
                    self.counters.held.set(r.held);
                }
                Err(err) => tracing::debug!(error = %err, "webhook gauges not refreshed"),
            }
            tokio::time::sleep(gauges_pause(started.elapsed())).await;
        }
    }
}

/// The pause after a read of the backlog gauges that took `read`: 5 s, or 50 times the read,
/// at most a minute. The read counts every pending delivery, so its time grows with a backlog
/// (an endpoint down for days holds hundreds of thousands: 0.2 s and three backends a read
/// at 480,000 on two cores); so the share of the database's time it takes stays at most 2 %
/// a replica, up to reads of 1.2 s. The alerts on these gauges wait 15 minutes.
fn gauges_pause(read: Duration) -> Duration {
    read.saturating_mul(50)
        .clamp(Duration::from_secs(5), Duration::from_secs(60))
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A worker's attempts in flight per tenant and per endpoint, and the room each has in a
/// claim.
#[derive(Default)]
struct Shares {
    in_flight: HashMap<Uuid, usize>,
    /// By (tenant, endpoint).
    endpoints: HashMap<(Uuid, Uuid), usize>,
}

/// What a claim may take per tenant and per endpoint (`oncepay_webhook_claim_scheduled`'s
/// last seven arguments).
#[derive(Debug, PartialEq)]
struct Rooms {
    tenants: Vec<Uuid>,
    rooms: Vec<i32>,
    /// Any tenant without attempts in flight: its room, also its share.
    others: i32,
    /// Per tenant of `tenants`: its share, and how many of its endpoints are busy.
    shares: Vec<i32>,
    busy: Vec<i32>,
    /// The busy endpoints and their attempts in flight.
    endpoints: Vec<Uuid>,
    endpoint_in_flight: Vec<i32>,
}

impl Shares {
    fn started(&mut self, tenant: Uuid, endpoint: Uuid) {
        *self.in_flight.entry(tenant).or_default() += 1;
        *self.endpoints.entry((tenant, endpoint)).or_default() += 1;
    }

    fn ended(&mut self, tenant: Uuid, endpoint: Uuid) {
        fn less<K: std::hash::Hash + Eq>(map: &mut HashMap<K, usize>, key: K) {
            if let Some(n) = map.get_mut(&key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    map.remove(&key);
                }
            }
        }
        less(&mut self.in_flight, tenant);
        less(&mut self.endpoints, (tenant, endpoint));
    }

    /// With `k` tenants in flight, each gets `slots / (k + 1)` (at least one) less what it has
    /// in flight, and a tenant with none in flight `slots / (k + 2)`, the share it would have
    /// once in flight: whoever comes next finds a share free. (A tenant alone uses at most
    /// half of the slots.) A tenant's share is split between its endpoints by the same rule
    /// (in the claim, which also counts the endpoints it makes busy, and splits a share in no
    /// more parts than the tenant has endpoints enabled): found from outside, two
    /// hanging endpoints of a tenant held its whole share and its healthy endpoint, created
    /// after them, got 10 of 313 events in 80 s.
    fn rooms(&self, slots: usize) -> Rooms {
        let active = self.in_flight.len();
        let share = |tenants: usize| i32::try_from((slots / (tenants + 1)).max(1)).unwrap_or(i32::MAX);
        let count = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
        let mut rooms = Rooms {
            tenants: Vec::with_capacity(active),
            rooms: Vec::with_capacity(active),
            others: share(active + 1),
            shares: Vec::with_capacity(active),
            busy: Vec::with_capacity(active),
            endpoints: Vec::with_capacity(self.endpoints.len()),
            endpoint_in_flight: Vec::with_capacity(self.endpoints.len()),
        };
        for (tenant, n) in &self.in_flight {
            rooms.tenants.push(*tenant);
            rooms.rooms.push(share(active).saturating_sub(count(*n)).max(0));
            rooms.shares.push(share(active));
            rooms
                .busy
                .push(count(self.endpoints.keys().filter(|(t, _)| t == tenant).count()));
        }
        for ((_, endpoint), n) in &self.endpoints {
            rooms.endpoints.push(*endpoint);
            rooms.endpoint_in_flight.push(count(*n));
        }
        rooms
    }
}

/// Records attempts' results (`oncepay_webhook_record_results`), in one statement; gives per
/// result whether it settled its delivery (`None`: it could not be recorded at all, and was
/// dropped), and the endpoints the results disabled for failing ([`Recorded`]). If PostgreSQL refuses the statement for what the results carry, not for the
/// state of the database, each result is recorded alone, and one that still cannot be is
/// recorded without the receiver's answer (its head and error): one result never keeps
/// another from being recorded. `Err` only for what may pass (the database unreachable, a
/// transient failure): nothing is known recorded then, and the caller tries again (recording
/// a result twice changes nothing more).
pub async fn record_results(
    db: &Db,
    replica: &str,
    health: Health,
    results: &[AttemptResult],
) -> Result<Recorded, DbError> {
    let mut disabled_for_failing = Vec::new();
    match record_statement(db, replica, health, results).await {
        Ok(one) => {
            return Ok(Recorded {
                applied: one.applied.into_iter().map(Some).collect(),
                gave_up: one.gave_up,
                disabled_for_failing: one.disabled_for_failing,
            })
        }
        Err(DbError::Other(err)) if results.len() > 1 => {
            tracing::warn!(error = %err, attempts = results.len(),
                "webhook attempts refused as a batch; recording them one by one");
        }
        Err(DbError::Other(_)) => {}
        Err(err) => return Err(err),
    }
    let mut applied = Vec::with_capacity(results.len());
    let mut gave_up = Vec::with_capacity(results.len());
    for result in results {
        let alone = std::slice::from_ref(result);
        let one = match record_statement(db, replica, health, alone).await {
            Ok(one) => Some(one),
            Err(DbError::Other(err)) => {
                let mut bare = result.clone();
                bare.head = None;
                bare.error = Some("the receiver's answer could not be stored".to_owned());
                match record_statement(db, replica, health, std::slice::from_ref(&bare)).await {
                    Ok(one) => {
                        tracing::warn!(error = %err, event = %result.event, endpoint = %result.endpoint,
                            "a webhook attempt was recorded without the receiver's answer");
                        Some(one)
                    }
                    Err(DbError::Other(again)) => {
                        tracing::error!(error = %again, event = %result.event, endpoint = %result.endpoint,
                            "a webhook attempt could not be recorded; it will be sent again after its lease");
                        None
                    }
                    Err(other) => return Err(other),
                }
            }
            Err(other) => return Err(other),
        };
        if let Some(one) = one {
            applied.push(one.applied.first().copied());
            gave_up.push(one.gave_up.first().copied().unwrap_or(false));
            disabled_for_failing.extend(one.disabled_for_failing);
        } else {
            applied.push(None);
            gave_up.push(false);
        }
    }
    Ok(Recorded {
        applied,
        gave_up,
        disabled_for_failing,
    })
}

/// What the endpoints' health is judged by when attempts are recorded (migrations/V22, V31).
#[derive(Clone, Copy, Debug)]
pub struct Health {
    /// `ONCEPAY_WEBHOOK_DISABLE_AFTER_SECS`: a failing stretch this long disables.
    pub disable_after: Duration,
    /// [`WebhookSettings::failing_pause`]: a pause with no attempt this long ends a stretch.
    pub pause: Duration,
}

impl Health {
    pub fn of(settings: &WebhookSettings) -> Self {
        Self {
            disable_after: settings.disable_after,
            pause: settings.failing_pause(),
        }
    }
}

/// What recording attempts did.
#[derive(Debug, Default)]
pub struct Recorded {
    /// Per result, whether it settled its delivery (`None`: it could not be recorded).
    pub applied: Vec<Option<bool>>,
    /// Per result, whether its record gave the delivery up: not for a `given_up` attempt
    /// whose schedule a recovery restarted while it was out (migrations/V33, V36), which goes
    /// again at once.
    pub gave_up: Vec<bool>,
    /// The endpoints (tenant, endpoint) disabled for failing by these results.
    pub disabled_for_failing: Vec<(Uuid, Uuid)>,
}

/// What one statement recorded: per result whether it settled its delivery and whether it
/// gave it up, and the endpoints it disabled for failing.
struct RecordedStatement {
    applied: Vec<bool>,
    gave_up: Vec<bool>,
    disabled_for_failing: Vec<(Uuid, Uuid)>,
}

/// One statement recording `results`.
async fn record_statement(
    db: &Db,
    replica: &str,
    health: Health,
    results: &[AttemptResult],
) -> Result<RecordedStatement, DbError> {
    let mut tenants = Vec::with_capacity(results.len());
    let mut events = Vec::with_capacity(results.len());
    let mut endpoints = Vec::with_capacity(results.len());
    let mut attempts = Vec::with_capacity(results.len());
    let mut started = Vec::with_capacity(results.len());
    let mut latencies = Vec::with_capacity(results.len());
    let mut statuses = Vec::with_capacity(results.len());
    let mut heads = Vec::with_capacity(results.len());
    let mut errors = Vec::with_capacity(results.len());
    let mut outcomes = Vec::with_capacity(results.len());
    let mut nexts = Vec::with_capacity(results.len());
    for r in results {
        tenants.push(r.tenant);
        events.push(r.event);
        endpoints.push(r.endpoint);
        attempts.push(r.attempt);
        started.push(r.started_at);
        latencies.push(i32::try_from(r.latency.as_millis()).unwrap_or(i32::MAX));
        statuses.push(r.status.map(|s| i16::try_from(s).unwrap_or(i16::MAX)));
        heads.push(r.head.clone());
        errors.push(r.error.clone());
        outcomes.push(r.outcome.as_str().to_owned());
        nexts.push(r.outcome.next_attempt_at());
    }
    let disable_after = i32::try_from(health.disable_after.as_secs()).unwrap_or(i32::MAX);
    let pause = i32::try_from(health.pause.as_secs_f64().ceil() as u64).unwrap_or(i32::MAX);
    let rows = db
        .run(async |conn| {
            sqlx::query!(
                r#"SELECT tenant AS "tenant!", event_id, endpoint_id AS "endpoint_id!", applied AS "applied!",
                          disabled_for_failing AS "disabled_for_failing!", gave_up AS "gave_up!"
                     FROM oncepay_webhook_record_results($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)"#,
                &tenants,
                &events,
                &endpoints,
                &attempts,
                &started,
                &latencies,
                &statuses as &[Option<i16>],
                &heads as &[Option<String>],
                &errors as &[Option<String>],
                replica,
                &outcomes,
                &nexts as &[Option<DateTime<Utc>>],
                disable_after,
                pause,
            )
            .fetch_all(conn)
            .await
        })
        .await?;
    let row_of = |r: &AttemptResult| {
        rows.iter()
            .find(|row| row.applied && row.event_id == Some(r.event) && row.endpoint_id == r.endpoint)
    };
    Ok(RecordedStatement {
        applied: results.iter().map(|r| row_of(r).is_some()).collect(),
        gave_up: results
            .iter()
            .map(|r| row_of(r).is_some_and(|row| row.gave_up))
            .collect(),
        disabled_for_failing: rows
            .iter()
            .filter(|row| row.disabled_for_failing)
            .map(|row| (row.tenant, row.endpoint_id))
            .collect(),
    })
}

/// The first bytes of an answer as text that holds any byte sequence, losing nothing: valid
/// UTF-8 as it is, but a backslash doubled and a control character other than tab, CR and LF
/// written `\u{..}` (PostgreSQL's text cannot hold U+0000); each byte of invalid UTF-8 (a
/// binary body, a character cut at the limit) written `\xNN`.
pub fn readable_head(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut text = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        for ch in chunk.valid().chars() {
            match ch {
                '\\' => text.push_str("\\\\"),
                '\t' | '\r' | '\n' => text.push(ch),
                c if c.is_control() => {
                    let _ = write!(text, "\\u{{{:x}}}", c as u32);
                }
                c => text.push(c),
            }
        }
        for byte in chunk.invalid() {
            let _ = write!(text, "\\x{byte:02x}");
        }
    }
    text
}

/// The wait before attempt `attempt + 1`, after attempt `attempt` (1-based) failed: the
/// schedule's entry with ±10 % jitter, and at least the receiver's `Retry-After`; `None`
/// when the schedule is spent (the delivery is given up).
fn next_wait(schedule: &[Duration], attempt: i32, retry_after: Option<Duration>) -> Option<Duration> {
    let base = *schedule.get(usize::try_from(attempt).ok()?.checked_sub(1)?)?;
    let jittered = base.mul_f64(rand::thread_rng().gen_range(0.9..=1.1));
    // A Retry-After longer than the schedule's longest wait is capped there.
    let longest = schedule.iter().max().copied().unwrap_or(base);
    Some(match retry_after {
        Some(asked) => jittered.max(asked.min(longest)),
        None => jittered,
    })
}

/// `Retry-After` in seconds or as an HTTP date.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let raw = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = raw.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = DateTime::parse_from_rfc2822(raw).ok()?;
    (at.with_timezone(&Utc) - Utc::now()).to_std().ok()
}

fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gauges_are_read_every_5_s_and_a_slow_read_spends_at_most_2_percent() {
        let pause = |ms| gauges_pause(Duration::from_millis(ms));
        assert_eq!(pause(5), Duration::from_secs(5), "a small backlog: as often as ever");
        assert_eq!(pause(100), Duration::from_secs(5));
        assert_eq!(pause(220), Duration::from_secs(11), "480,000 pending, as measured");
        assert_eq!(pause(1_200), Duration::from_secs(60));
        assert_eq!(pause(10_000), Duration::from_secs(60), "at least once a minute");
    }

    #[test]
    fn the_schedule_is_followed_with_jitter_then_given_up() {
        let schedule = [Duration::from_secs(10), Duration::from_secs(100)];
        for _ in 0..100 {
            let first = next_wait(&schedule, 1, None).unwrap();
            assert!((9.0..=11.0).contains(&first.as_secs_f64()), "{first:?}");
            let second = next_wait(&schedule, 2, None).unwrap();
            assert!((90.0..=110.0).contains(&second.as_secs_f64()), "{second:?}");
        }
        assert_eq!(next_wait(&schedule, 3, None), None);
        assert_eq!(next_wait(&schedule, 0, None), None);
    }

    #[test]
    fn any_answer_becomes_text_without_a_nul_and_nothing_is_lost() {
        assert_eq!(readable_head(b"ok"), "ok");
        assert_eq!(readable_head(b"a\0b"), "a\\u{0}b");
        assert_eq!(readable_head(b"\xff\xfe{}"), "\\xff\\xfe{}");
        assert_eq!(
            readable_head("caf\u{e9} \\ \u{1b}[0m\n".as_bytes()),
            "caf\u{e9} \\\\ \\u{1b}[0m\n"
        );
        // A character cut at the limit.
        assert_eq!(readable_head(&"\u{e9}".as_bytes()[..1]), "\\xc3");
        for bytes in [&b"a\0b"[..], b"\xff\x00\xc3", b"\\x00"] {
            assert!(!readable_head(bytes).contains('\0'));
        }
        // Distinct answers stay distinct: a literal `\x00` is not a NUL byte.
        assert_ne!(readable_head(b"\\x00"), readable_head(b"\x00"));
    }

    #[test]
    fn each_tenant_in_flight_gets_a_share_and_a_share_stays_free_for_another() {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let (a1, b1) = (Uuid::new_v4(), Uuid::new_v4());
        let mut shares = Shares::default();
        // Nobody in flight: the first tenant may take half, the other half stays free.
        let rooms = shares.rooms(64);
        assert_eq!((rooms.tenants, rooms.rooms, rooms.others), (vec![], vec![], 32));
        for _ in 0..40 {
            shares.started(a, a1);
        }
        // One tenant in flight, over its half: no room for it, a third for the next.
        let rooms = shares.rooms(64);
        assert_eq!(
            (rooms.tenants.clone(), rooms.rooms.clone(), rooms.others),
            (vec![a], vec![0], 21)
        );
        shares.started(b, b1);
        let rooms = shares.rooms(64);
        let room_of = |t: Uuid| rooms.rooms[rooms.tenants.iter().position(|x| *x == t).unwrap()];
        assert_eq!((room_of(a), room_of(b), rooms.others), (0, 20, 16));
        for _ in 0..40 {
            shares.ended(a, a1);
        }
        shares.ended(b, b1);
        assert!(
            shares.in_flight.is_empty() && shares.endpoints.is_empty(),
            "no tenant or endpoint left behind: {:?} {:?}",
            shares.in_flight,
            shares.endpoints
        );
        // A single slot is still a share.
        shares.started(a, a1);
        assert_eq!(shares.rooms(1).others, 1);
    }

    /// The claim splits a tenant's share between its endpoints as the slots are split
    /// between tenants: it is told each tenant's share, how many of its endpoints are busy,
    /// and what each busy endpoint has in flight.
    #[test]
    fn a_claim_is_told_each_tenants_share_and_its_busy_endpoints() {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let (a1, a2, b1) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let mut shares = Shares::default();
        for _ in 0..10 {
            shares.started(a, a1);
        }
        for _ in 0..3 {
            shares.started(a, a2);
        }
        shares.started(b, b1);
        let rooms = shares.rooms(64);
        let at = |t: Uuid| rooms.tenants.iter().position(|x| *x == t).unwrap();
        // Two tenants in flight: a third of the slots each.
        assert_eq!((rooms.shares[at(a)], rooms.busy[at(a)], rooms.rooms[at(a)]), (21, 2, 8));
        assert_eq!(
            (rooms.shares[at(b)], rooms.busy[at(b)], rooms.rooms[at(b)]),
            (21, 1, 20)
        );
        let in_flight = |e: Uuid| rooms.endpoint_in_flight[rooms.endpoints.iter().position(|x| *x == e).unwrap()];
        assert_eq!((in_flight(a1), in_flight(a2), in_flight(b1)), (10, 3, 1));
        assert_eq!(rooms.endpoints.len(), 3);
        for _ in 0..3 {
            shares.ended(a, a2);
        }
        let rooms = shares.rooms(64);
        assert_eq!(rooms.busy[rooms.tenants.iter().position(|x| *x == a).unwrap()], 1);
        assert!(
            !rooms.endpoints.contains(&a2),
            "an endpoint with nothing in flight is not busy"
        );
    }

    #[test]
    fn retry_after_lengthens_a_wait_up_to_the_longest_of_the_schedule() {
        let schedule = [Duration::from_secs(1), Duration::from_secs(100)];
        let wait = next_wait(&schedule, 1, Some(Duration::from_secs(30))).unwrap();
        assert_eq!(wait, Duration::from_secs(30));
        let wait = next_wait(&schedule, 1, Some(Duration::from_secs(10_000))).unwrap();
        assert_eq!(wait, Duration::from_secs(100));
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, "7".parse().unwrap());
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(7)));
    }
}
