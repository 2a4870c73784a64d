//! The event log and its repair (docs/webhooks.md, "Delivering again"): the events kept
//! (`ONCEPAY_EVENT_RETENTION_DAYS`, delivered or not) and an endpoint's attempts, listed like
//! every list (`crate::ledger::lists` says how), and the two operations that deliver again:
//! resend (one event to one endpoint) and recover (every event an endpoint never acknowledged
//! since a time). Both reopen the event's delivery row, so that it goes out with its
//! `webhook-id`, in its place among its resource's deliveries not yet made, and with a new
//! retry schedule (migrations/V24).

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use super::endpoints::EventRow;
use crate::db::{Conn, DbError};
use crate::domain::page::{Page, PageRequest};
use crate::domain::{AttemptId, EndpointId, EventId, TenantId};
use crate::ledger::{settle, ClaimArgs, Effect, Outcome, Reply};
use crate::operation::{ClaimOutcome, Decline, Operation};

/// `GET /events`: the tenant's events, of one type if given. `None`: the cursor is no event
/// of the tenant's.
pub async fn events(
    conn: &mut PgConnection,
    tenant: TenantId,
    event_type: Option<&str>,
    page: &PageRequest<EventId>,
) -> Result<Option<Page<EventRow>>, sqlx::Error> {
    let cursor = page.cursor_id().map(|id| id.get());
    let (from, until) = (page.created.from, page.created.until);
    // A payment's event is stored without its data, rendered here (migrations/V18).
    let rows = if page.newer() {
        sqlx::query!(
            r#"SELECT ev.event_id, ev.event_type, oncepay_event_data(ev) AS "data!", ev.created_at
                 FROM webhook_events ev
                WHERE ev.tenant_id = $1
                  AND (ev.created_at, ev.event_id) >
                      (CASE WHEN $3::timestamptz > (SELECT c.created_at FROM webhook_events c WHERE c.tenant_id = $1 AND c.event_id = $2) THEN $3::timestamptz ELSE (SELECT c.created_at FROM webhook_events c WHERE c.tenant_id = $1 AND c.event_id = $2) END,
                       CASE WHEN $3::timestamptz > (SELECT c.created_at FROM webhook_events c WHERE c.tenant_id = $1 AND c.event_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid ELSE $2 END)
                  AND ev.created_at >= coalesce($3::timestamptz, '-infinity') AND ev.created_at < coalesce($4::timestamptz, 'infinity')
                  AND ($5::text IS NULL OR ev.event_type = $5)
                ORDER BY ev.created_at, ev.event_id
                LIMIT $6"#,
            tenant.get(),
            cursor,
            from,
            until,
            event_type,
            page.fetch(),
        )
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(|r| (r.event_id, r.event_type, r.data, r.created_at))
        .collect::<Vec<_>>()
    } else {
        sqlx::query!(
            r#"SELECT ev.event_id, ev.event_type, oncepay_event_data(ev) AS "data!", ev.created_at
                 FROM webhook_events ev
                WHERE ev.tenant_id = $1
                  AND (ev.created_at, ev.event_id) <
                      (CASE WHEN $2::uuid IS NULL THEN coalesce($4::timestamptz, 'infinity')
                            WHEN $4::timestamptz <= (SELECT c.created_at FROM webhook_events c WHERE c.tenant_id = $1 AND c.event_id = $2) THEN $4::timestamptz
                            ELSE (SELECT c.created_at FROM webhook_events c WHERE c.tenant_id = $1 AND c.event_id = $2) END,
                       CASE WHEN $2::uuid IS NULL OR $4::timestamptz <= (SELECT c.created_at FROM webhook_events c WHERE c.tenant_id = $1 AND c.event_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid
                            ELSE $2 END)
                  AND ev.created_at >= coalesce($3::timestamptz, '-infinity') AND ev.created_at < coalesce($4::timestamptz, 'infinity')
                  AND ($5::text IS NULL OR ev.event_type = $5)
                ORDER BY ev.created_at DESC, ev.event_id DESC
                LIMIT $6"#,
            tenant.get(),
            cursor,
            from,
            until,
            event_type,
            page.fetch(),
        )
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(|r| (r.event_id, r.event_type, r.data, r.created_at))
        .collect::<Vec<_>>()
    };
    if let (true, Some(id)) = (rows.is_empty(), cursor) {
        let known = sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT FROM webhook_events WHERE tenant_id = $1 AND event_id = $2) AS "known!""#,
            tenant.get(),
            id,
        )
        .fetch_one(&mut *conn)
        .await?;
        if !known {
            return Ok(None);
        }
    }
    Ok(Some(page.page(rows).map(|(id, event_type, data, created_at)| {
        EventRow {
            id: EventId::from_uuid(id),
            event_type,
            data,
            created_at,
        }
    })))
}

/// One attempt of a delivery, as listed.
#[derive(Clone, Debug)]
pub struct AttemptRow {
    pub id: AttemptId,
    pub attempted_at: DateTime<Utc>,
    /// The receiver's status; `None` when no answer came (a timeout, a refused connection).
    pub status: Option<i16>,
    pub error: Option<String>,
    pub latency_ms: i32,
}

/// Which attempts a list keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// A 2xx.
    Succeeded,
    /// Anything else: another status, or no answer.
    Failed,
}

impl AttemptOutcome {
    pub fn parse(raw: &str) -> Option<Self> {
        match raw {
            "succeeded" => Some(Self::Succeeded),
            "failed" => Some(Self::Failed),
            _ => None,
        }
    }
}

/// Why an endpoint's attempts cannot be listed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttemptsRefused {
    /// No such endpoint of the tenant's (or deleted).
    UnknownEndpoint,
    /// The cursor is no attempt of this endpoint's.
    UnknownCursor,
}

/// `GET /webhook-endpoints/{id}/attempts`: the endpoint's attempts, newest first, ordered by
/// (start, event, number).
pub async fn attempts(
    conn: &mut PgConnection,
    tenant: TenantId,
    endpoint: EndpointId,
    outcome: Option<AttemptOutcome>,
    page: &PageRequest<AttemptId>,
) -> Result<Result<Page<AttemptRow>, AttemptsRefused>, sqlx::Error> {
    let known = sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT FROM webhook_endpoints
                           WHERE tenant_id = $1 AND endpoint_id = $2 AND deleted_at IS NULL) AS "known!""#,
        tenant.get(),
        endpoint.get(),
    )
    .fetch_one(&mut *conn)
    .await?;
    if !known {
        return Ok(Err(AttemptsRefused::UnknownEndpoint));
    }
    let cursor_event = page.cursor_id().map(|id| id.event.get());
    let cursor_attempt = page.cursor_id().map(|id| id.attempt);
    let (from, until) = (page.created.from, page.created.until);
    let failed = outcome.map(|o| o == AttemptOutcome::Failed);
    let rows = if page.newer() {
        sqlx::query!(
            r#"SELECT a.event_id, a.attempt, a.started_at, a.status, a.error, a.latency_ms
                 FROM webhook_attempts a
                WHERE a.tenant_id = $1 AND a.endpoint_id = $2
                  AND (a.started_at, a.event_id, a.attempt) >
                      (CASE WHEN $5::timestamptz > (SELECT c.started_at FROM webhook_attempts c WHERE c.tenant_id = $1 AND c.event_id = $3 AND c.endpoint_id = $2 AND c.attempt = $4) THEN $5::timestamptz ELSE (SELECT c.started_at FROM webhook_attempts c WHERE c.tenant_id = $1 AND c.event_id = $3 AND c.endpoint_id = $2 AND c.attempt = $4) END,
                       CASE WHEN $5::timestamptz > (SELECT c.started_at FROM webhook_attempts c WHERE c.tenant_id = $1 AND c.event_id = $3 AND c.endpoint_id = $2 AND c.attempt = $4) THEN '00000000-0000-0000-0000-000000000000'::uuid ELSE $3 END,
                       CASE WHEN $5::timestamptz > (SELECT c.started_at FROM webhook_attempts c WHERE c.tenant_id = $1 AND c.event_id = $3 AND c.endpoint_id = $2 AND c.attempt = $4) THEN 0 ELSE $4 END)
                  AND a.started_at >= coalesce($5::timestamptz, '-infinity') AND a.started_at < coalesce($6::timestamptz, 'infinity')
                  AND ($7::boolean IS NULL OR $7 = (a.status IS NULL OR a.status NOT BETWEEN 200 AND 299))
                ORDER BY a.started_at, a.event_id, a.attempt
                LIMIT $8"#,
            tenant.get(),
            endpoint.get(),
            cursor_event,
            cursor_attempt,
            from,
            until,
            failed,
            page.fetch(),
        )
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(|r| (r.event_id, r.attempt, r.started_at, r.status, r.error, r.latency_ms))
        .collect::<Vec<_>>()
    } else {
        sqlx::query!(
            r#"SELECT a.event_id, a.attempt, a.started_at, a.status, a.error, a.latency_ms
                 FROM webhook_attempts a
                WHERE a.tenant_id = $1 AND a.endpoint_id = $2
                  AND (a.started_at, a.event_id, a.attempt) <
                      (CASE WHEN $3::uuid IS NULL THEN coalesce($6::timestamptz, 'infinity')
                            WHEN $6::timestamptz <= (SELECT c.started_at FROM webhook_attempts c WHERE c.tenant_id = $1 AND c.event_id = $3 AND c.endpoint_id = $2 AND c.attempt = $4) THEN $6::timestamptz
                            ELSE (SELECT c.started_at FROM webhook_attempts c WHERE c.tenant_id = $1 AND c.event_id = $3 AND c.endpoint_id = $2 AND c.attempt = $4) END,
                       CASE WHEN $3::uuid IS NULL OR $6::timestamptz <= (SELECT c.started_at FROM webhook_attempts c WHERE c.tenant_id = $1 AND c.event_id = $3 AND c.endpoint_id = $2 AND c.attempt = $4)
                            THEN '00000000-0000-0000-0000-000000000000'::uuid ELSE $3 END,
                       CASE WHEN $3::uuid IS NULL OR $6::timestamptz <= (SELECT c.started_at FROM webhook_attempts c WHERE c.tenant_id = $1 AND c.event_id = $3 AND c.endpoint_id = $2 AND c.attempt = $4) THEN 0 ELSE $4::int END)
                  AND a.started_at >= coalesce($5::timestamptz, '-infinity') AND a.started_at < coalesce($6::timestamptz, 'infinity')
                  AND ($7::boolean IS NULL OR $7 = (a.status IS NULL OR a.status NOT BETWEEN 200 AND 299))
                ORDER BY a.started_at DESC, a.event_id DESC, a.attempt DESC
                LIMIT $8"#,
            tenant.get(),
            endpoint.get(),
            cursor_event,
            cursor_attempt,
            from,
            until,
            failed,
            page.fetch(),
        )
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(|r| (r.event_id, r.attempt, r.started_at, r.status, r.error, r.latency_ms))
        .collect::<Vec<_>>()
    };
    if let (true, Some(id)) = (rows.is_empty(), page.cursor_id()) {
        let known = sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT FROM webhook_attempts
                               WHERE tenant_id = $1 AND event_id = $2 AND endpoint_id = $3 AND attempt = $4) AS "known!""#,
            tenant.get(),
            id.event.get(),
            endpoint.get(),
            id.attempt,
        )
        .fetch_one(&mut *conn)
        .await?;
        if !known {
            return Ok(Err(AttemptsRefused::UnknownCursor));
        }
    }
    Ok(Ok(page.page(rows).map(
        |(event, attempt, attempted_at, status, error, latency_ms)| AttemptRow {
            id: AttemptId {
                event: EventId::from_uuid(event),
                attempt,
            },
            attempted_at,
            status,
            error,
            latency_ms,
        },
    )))
}

/// Delivers an event once more to an endpoint (`oncepay_resend_webhook_event`).
pub struct Resend {
    pub endpoint: EndpointId,
    pub event: EventId,
}

/// A resend, as answered (its first answer and its replays alike).
#[derive(Clone, Debug)]
pub struct Resent {
    pub endpoint: EndpointId,
    pub event: EventId,
}

impl Effect for Resend {
    const OPERATION: Operation = Operation::ResendWebhookEvent;
    type Row = Resent;

    async fn run(
        &self,
        conn: &mut PgConnection,
        tenant: TenantId,
        claim: &ClaimArgs,
    ) -> Result<Outcome<Resent>, sqlx::Error> {
        let r = sqlx::query!(
            r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at, resource
               FROM oncepay_resend_webhook_event($1, $2, $3, $4)"#,
            tenant.get(),
            claim as _,
            self.endpoint.get(),
            self.event.get(),
        )
        .fetch_one(conn)
        .await?;
        let outcome = settle(r.outcome, r.decline, r.expires_at, r.resource)?;
        Ok(resolved(outcome, |event| Resent {
            endpoint: self.endpoint,
            event: EventId::from_uuid(event),
        }))
    }
}

/// Delivers again whatever an endpoint never acknowledged since a time: in slices
/// ([`Recover::run_slices`]), then the keyed transaction (`oncepay_recover_webhook_endpoint`)
/// over what is left, which stores the answer.
pub struct Recover {
    pub endpoint: EndpointId,
    pub since: DateTime<Utc>,
    /// The deliveries a keyless request's slices changed, counted in the answer (a keyed
    /// request's are added up under its key in the database, so that its retry counts them).
    pub prior: i32,
}

impl Recover {
    /// Runs the recovery's slices (migrations/V51), each a transaction of at most about
    /// `slice` deliveries, so that none holds rows or its endpoint for long however long the
    /// outage was: the given-up and cancelled reopened oldest first, then those waiting for a
    /// retry made due. What they changed is added up under the claim's key and fingerprint,
    /// or, for a keyless request, to `prior`. A failure leaves the slices that committed (a
    /// retry finds them done, their count kept under its key); an unknown endpoint runs none
    /// (the keyed transaction answers 404).
    pub async fn run_slices(
        &mut self,
        conn: &mut Conn,
        tenant: TenantId,
        claim: &ClaimArgs,
        slice: u32,
    ) -> Result<Slices, DbError> {
        let (key, fingerprint) = (claim.key(), claim.fingerprint());
        let limit = i32::try_from(slice).unwrap_or(i32::MAX).max(1);
        let mut done = Slices::default();
        let mut after: Option<DateTime<Utc>> = None;
        loop {
            let r = conn
                .run(async |c| {
                    sqlx::query!(
                        r#"SELECT known AS "known!", changed AS "changed!", last_created
                             FROM oncepay_recover_webhook_reopen($1, $2, $3, $4, $5, $6, $7)"#,
                        tenant.get(),
                        self.endpoint.get(),
                        self.since,
                        after,
                        limit,
                        key,
                        fingerprint,
                    )
                    .fetch_one(c)
                    .await
                })
                .await?;
            done.add(r.changed);
            if !r.known {
                return Ok(done);
            }
            match r.last_created {
                Some(last) => after = Some(last),
                None => break,
            }
        }
        let mut after: (Option<DateTime<Utc>>, Option<i64>) = (None, None);
        loop {
            let r = conn
                .run(async |c| {
                    sqlx::query!(
                        r#"SELECT changed AS "changed!", last_at, last_sequence
                             FROM oncepay_recover_webhook_reschedule($1, $2, $3, $4, $5, $6, $7, $8)"#,
                        tenant.get(),
                        self.endpoint.get(),
                        self.since,
                        after.0,
                        after.1,
                        limit,
                        key,
                        fingerprint,
                    )
                    .fetch_one(c)
                    .await
                })
                .await?;
            done.add(r.changed);
            match (r.last_at, r.last_sequence) {
                (Some(at), Some(sequence)) => after = (Some(at), Some(sequence)),
                _ => break,
            }
        }
        if key.is_none() {
            self.prior = self.prior.saturating_add(done.deliveries);
        }
        Ok(done)
    }
}

/// What a recovery's slices did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slices {
    /// Transactions run.
    pub slices: u32,
    /// Deliveries they changed.
    pub deliveries: i32,
}

impl Slices {
    fn add(&mut self, changed: i32) {
        self.slices += 1;
        self.deliveries = self.deliveries.saturating_add(changed);
    }
}

/// A recovery's row (`webhook_recoveries`): its answer.
#[derive(Clone, Debug, sqlx::Type)]
#[sqlx(type_name = "webhook_recoveries")]
pub struct RecoveryRow {
    pub tenant_id: Uuid,
    pub recovery_id: Uuid,
    pub endpoint_id: Uuid,
    pub since: DateTime<Utc>,
    /// The deliveries it made due: reopened (given up, cancelled) or due now (waiting for a
    /// retry).
    pub deliveries: i32,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
}

impl Effect for Recover {
    const OPERATION: Operation = Operation::RecoverWebhookEndpoint;
    type Row = RecoveryRow;

    async fn run(
        &self,
        conn: &mut PgConnection,
        tenant: TenantId,
        claim: &ClaimArgs,
    ) -> Result<Outcome<RecoveryRow>, sqlx::Error> {
        let r = sqlx::query!(
            r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                      resource AS "resource: RecoveryRow"
               FROM oncepay_recover_webhook_endpoint($1, $2, $3, $4, $5)"#,
            tenant.get(),
            claim as _,
            self.endpoint.get(),
            self.since,
            self.prior,
        )
        .fetch_one(conn)
        .await?;
        settle(r.outcome, r.decline, r.expires_at, r.resource)
    }
}

/// The outcome with its resource turned into the answer's row.
fn resolved<A, B>(outcome: Outcome<A>, f: impl FnOnce(A) -> B) -> Outcome<B> {
    let result = match outcome.result {
        Ok(Reply::New(a)) => Ok(Reply::New(f(a))),
        Ok(Reply::Replayed(a)) => Ok(Reply::Replayed(f(a))),
        Err(refusal) => Err(refusal),
    };
    Outcome {
        result,
        expires_at: outcome.expires_at,
    }
}
