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
//! recorded (`oncepay_webhook_record_many`, every attempt that ended since the worker's last
//! round trip at once, migrations/V11): a 2xx is a delivery; 410 Gone disables the endpoint;
//! anything else (another status, a timeout, a connection refused or cut before the answer)
//! is retried after the next wait of `ONCEPAY_WEBHOOK_RETRY_SCHEDULE` (±10 % jitter; at
//! least `Retry-After` on 429 and 503), and after the last the delivery is given up and the
//! endpoint disabled. A replica that dies mid-attempt leaves its lease to run out; another
//! replica then sends the same event again, with the same `webhook-id`: delivery is at least
//! once, and receivers deduplicate by that id (docs/webhooks.md).

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use prometheus::{Gauge, Histogram, IntCounterVec, IntGauge, IntGaugeVec};
use rand::Rng as _;
use reqwest::header::{HeaderMap, CONTENT_TYPE, RETRY_AFTER};
use tokio::sync::{mpsc, Semaphore};
use uuid::Uuid;

use super::secrets::SecretBox;
use super::{endpoints, signing, target};
use crate::config::WebhookSettings;
use crate::db::{Db, DbError};

/// Bytes of an answer kept with its attempt.
const RESPONSE_HEAD_BYTES: usize = 256;
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
    /// `oncepay_webhook_endpoints_disabled_total{reason}`: gone (410), failing (schedule spent).
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
}

/// One claimed delivery.
#[derive(Debug)]
struct Claimed {
    tenant: Uuid,
    event: Uuid,
    endpoint: Uuid,
    attempt: i32,
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
    Failed { retry_after: Option<Duration> },
}

/// An attempt that ended, to be recorded.
struct Ended {
    claimed: Claimed,
    attempt: Attempt,
    /// `delivered`, `retry` (at `next`), `given_up`, `gone`.
    outcome: &'static str,
    next: Option<DateTime<Utc>>,
    /// Past this its lease may have run out: the result is dropped if still unrecorded.
    record_by: Instant,
}

/// The attempt as recorded.
struct Attempt {
    started_at: DateTime<Utc>,
    latency: Duration,
    status: Option<u16>,
    head: Option<String>,
    error: Option<String>,
    verdict: Verdict,
}

pub struct Deliverer {
    db: Db,
    sealer: Arc<SecretBox>,
    http: reqwest::Client,
    settings: WebhookSettings,
    replica: String,
    counters: Counters,
}

impl Deliverer {
    pub fn new(db: Db, sealer: Arc<SecretBox>, settings: WebhookSettings, counters: Counters) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .dns_resolver(Arc::new(target::GuardedResolver {
                allow_private: settings.allow_private,
            }))
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
        })
    }

    /// Runs the worker until the task is dropped. One round trip at a time, in a loop: the
    /// attempts that ended since the last are recorded together, then as many due deliveries
    /// are claimed as attempts may start. It claims again at once when it took all it asked
    /// for (more may be due), and otherwise waits for an attempt to end or for
    /// `ONCEPAY_WEBHOOK_POLL_MS`, whichever comes first: an endpoint at its bound gets its
    /// next delivery as soon as one of its attempts ends, not a poll later.
    pub async fn run(self: Arc<Self>) {
        let slots = Arc::new(Semaphore::new(self.settings.concurrency));
        let (ended_tx, mut ended_rx) = mpsc::unbounded_channel::<Ended>();
        let gauges = tokio::spawn(self.clone().refresh_gauges());
        let _stop_gauges = AbortOnDrop(gauges);
        let mut ended = Vec::new();
        let mut fanned_out: Option<Instant> = None;
        loop {
            while let Ok(e) = ended_rx.try_recv() {
                ended.push(e);
            }
            if !ended.is_empty() && !self.record(&mut ended).await {
                tokio::time::sleep(RECORD_RETRY).await;
                continue;
            }
            let free = slots.available_permits().min(CLAIM_MAX);
            let mut more_due = false;
            if free > 0 {
                let fan_out = fanned_out.is_none_or(|t| t.elapsed() >= FAN_OUT_EVERY);
                if fan_out {
                    fanned_out = Some(Instant::now());
                }
                match self.claim(free, fan_out).await {
                    Ok(claimed) => {
                        more_due = claimed.len() == free;
                        for c in claimed {
                            let Ok(permit) = slots.clone().acquire_owned().await else {
                                return;
                            };
                            let (this, tx) = (self.clone(), ended_tx.clone());
                            tokio::spawn(async move {
                                let e = this.deliver(c).await;
                                drop(permit);
                                // Only fails once the worker is gone: the lease then runs out.
                                let _ = tx.send(e);
                            });
                        }
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "webhook claim failed; will try again");
                        tokio::time::sleep(self.settings.poll.max(Duration::from_secs(1))).await;
                        continue;
                    }
                }
            }
            if !more_due {
                if let Ok(Some(e)) = tokio::time::timeout(self.settings.poll, ended_rx.recv()).await {
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

    /// Claims up to `n` due deliveries, first writing those of newly committed events if
    /// `fan_out`.
    async fn claim(&self, n: usize, fan_out: bool) -> Result<Vec<Claimed>, DbError> {
        let lease = self.settings.timeout + LEASE_MARGIN;
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
                              created_at AS "created_at!"
                         FROM oncepay_webhook_claim($1, $2, $3, $4)"#,
                    limit,
                    per_endpoint,
                    lease_ms,
                    fan_out,
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
        let (outcome, next) = match &attempt.verdict {
            Verdict::Delivered => ("delivered", None),
            Verdict::Gone => ("gone", None),
            Verdict::Failed { retry_after } => {
                match next_wait(&self.settings.retry_schedule, c.attempt, *retry_after) {
                    Some(wait) => (
                        "retry",
                        Some(Utc::now() + chrono::Duration::from_std(wait).unwrap_or(chrono::Duration::MAX)),
                    ),
                    None => ("given_up", None),
                }
            }
        };
        tracing::info!(
            event = %c.event, endpoint = %c.endpoint, attempt = c.attempt, outcome,
            status = attempt.status, error = attempt.error.as_deref(),
            latency_ms = attempt.latency.as_millis() as u64, "webhook attempt"
        );
        Ended {
            record_by: Instant::now() + LEASE_MARGIN,
            claimed: c,
            attempt,
            outcome,
            next,
        }
    }

    async fn attempt(&self, c: &Claimed) -> Attempt {
        let started_at = Utc::now();
        let clock = Instant::now();
        let failed = |error: String| Attempt {
            started_at,
            latency: clock.elapsed(),
            status: None,
            head: None,
            error: Some(error),
            verdict: Verdict::Failed { retry_after: None },
        };
        let keys = match self.keys(c) {
            Ok(keys) => keys,
            Err(err) => return failed(err.to_string()),
        };
        let url = match target::parse(&c.url) {
            Ok(url) => url,
            Err(err) => return failed(err.to_string()),
        };
        // A literal address is not resolved, so the resolver's guard does not see it.
        if let Some(ip) = url
            .host_str()
            .and_then(|h| h.trim_start_matches('[').trim_end_matches(']').parse().ok())
        {
            if !self.settings.allow_private && !target::is_public(ip) {
                return failed(target::Refused::Private(ip).to_string());
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
        let sent = tokio::time::timeout(self.settings.timeout, async {
            let mut response = request.send().await?;
            let status = response.status();
            let headers = response.headers().clone();
            let mut head = Vec::new();
            while head.len() < RESPONSE_HEAD_BYTES {
                match response.chunk().await {
                    Ok(Some(chunk)) => head.extend_from_slice(&chunk),
                    // A body cut short after the status is still an answer.
                    Ok(None) | Err(_) => break,
                }
            }
            head.truncate(RESPONSE_HEAD_BYTES);
            Ok::<_, reqwest::Error>((status, headers, head))
        })
        .await;
        let latency = clock.elapsed();
        match sent {
            Err(_) => failed(format!("no answer within {} ms", self.settings.timeout.as_millis())),
            Ok(Err(err)) => failed(error_chain(&err)),
            Ok(Ok((status, headers, head))) => {
                let verdict = if status.is_success() {
                    Verdict::Delivered
                } else if status.as_u16() == 410 {
                    Verdict::Gone
                } else {
                    let retry_after = matches!(status.as_u16(), 429 | 503)
                        .then(|| retry_after(&headers))
                        .flatten();
                    Verdict::Failed { retry_after }
                };
                Attempt {
                    started_at,
                    latency,
                    status: Some(status.as_u16()),
                    head: Some(String::from_utf8_lossy(&head).into_owned()),
                    error: None,
                    verdict,
                }
            }
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

    /// Records the ended attempts in one statement and empties `ended`; `false` if the
    /// database could not be reached, with the attempts still to be recorded left in
    /// `ended` (for about as long as their leases last: after that another replica may
    /// already have sent the event again, so the stale result is dropped and counted).
    async fn record(&self, ended: &mut Vec<Ended>) -> bool {
        let mut tenants = Vec::with_capacity(ended.len());
        let mut events = Vec::with_capacity(ended.len());
        let mut endpoints = Vec::with_capacity(ended.len());
        let mut attempts = Vec::with_capacity(ended.len());
        let mut started = Vec::with_capacity(ended.len());
        let mut latencies = Vec::with_capacity(ended.len());
        let mut statuses = Vec::with_capacity(ended.len());
        let mut heads = Vec::with_capacity(ended.len());
        let mut errors = Vec::with_capacity(ended.len());
        let mut outcomes = Vec::with_capacity(ended.len());
        let mut nexts = Vec::with_capacity(ended.len());
        for e in ended.iter() {
            tenants.push(e.claimed.tenant);
            events.push(e.claimed.event);
            endpoints.push(e.claimed.endpoint);
            attempts.push(e.claimed.attempt);
            started.push(e.attempt.started_at);
            latencies.push(i32::try_from(e.attempt.latency.as_millis()).unwrap_or(i32::MAX));
            statuses.push(e.attempt.status.map(|s| s as i16));
            heads.push(e.attempt.head.clone());
            errors.push(e.attempt.error.clone());
            outcomes.push(e.outcome.to_owned());
            nexts.push(e.next);
        }
        let result = self
            .db
            .run(async |conn| {
                sqlx::query!(
                    r#"SELECT event_id AS "event_id!", endpoint_id AS "endpoint_id!", applied AS "applied!"
                         FROM oncepay_webhook_record_many($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"#,
                    &tenants,
                    &events,
                    &endpoints,
                    &attempts,
                    &started,
                    &latencies,
                    &statuses as &[Option<i16>],
                    &heads as &[Option<String>],
                    &errors as &[Option<String>],
                    self.replica,
                    &outcomes,
                    &nexts as &[Option<DateTime<Utc>>],
                )
                .fetch_all(conn)
                .await
            })
            .await;
        match result {
            Ok(rows) => {
                for e in ended.drain(..) {
                    self.counters.deliveries.with_label_values(&[e.outcome]).inc();
                    let applied = rows
                        .iter()
                        .any(|r| r.applied && r.event_id == e.claimed.event && r.endpoint_id == e.claimed.endpoint);
                    if applied && matches!(e.outcome, "gone" | "given_up") {
                        let reason = if e.outcome == "gone" { "gone" } else { "failing" };
                        self.counters.endpoints_disabled.with_label_values(&[reason]).inc();
                        tracing::warn!(endpoint = %e.claimed.endpoint, tenant = %e.claimed.tenant, reason,
                            "webhook endpoint disabled");
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

    /// The backlog gauges, every few seconds (one query over the pending deliveries).
    async fn refresh_gauges(self: Arc<Self>) {
        let mut ticker = tokio::time::interval(Duration::from_secs(5));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
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
                                    WHERE e.disabled_at IS NOT NULL AND e.deleted_at IS NULL) AS "disabled!"
                             FROM waiting w"#
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
                }
                Err(err) => tracing::debug!(error = %err, "webhook gauges not refreshed"),
            }
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
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
