//! `POST /webhook-endpoints`, its `rotate-secret` and `enable` as idempotent operations (their
//! key rows, their replays: the secret the request made, decrypted again, while it is still
//! the endpoint's), and the reads behind `GET /webhook-endpoints`,
//! `DELETE /webhook-endpoints/{id}` and `GET /events/{id}`.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use super::secrets::SecretBox;
use crate::domain::{EndpointId, EventId, TenantId};
use crate::ledger::{settle, ClaimArgs, Effect, Outcome, Reply};
use crate::operation::{ClaimOutcome, Decline, Operation};

/// The event types a tenant may subscribe to (the SQL domain `oncepay_webhook_event_type`).
pub const EVENT_TYPES: [&str; 8] = [
    "payment.succeeded",
    "payment.refunded",
    "deposit.succeeded",
    "transfer.succeeded",
    "top_up.succeeded",
    "top_up.failed",
    "top_up.refunded",
    "top_up.refund_failed",
];

/// A row of `webhook_endpoints`, whole, as the function returns it.
#[derive(Clone, Debug, sqlx::Type)]
#[sqlx(type_name = "webhook_endpoints")]
pub struct StoredEndpoint {
    pub tenant_id: Uuid,
    pub endpoint_id: Uuid,
    pub url: String,
    pub event_types: Option<Vec<String>>,
    pub secret_encrypted: Vec<u8>,
    pub previous_secret_encrypted: Option<Vec<u8>>,
    pub previous_secret_expires_at: Option<DateTime<Utc>>,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
    pub disabled_at: Option<DateTime<Utc>>,
    pub disabled_reason: Option<String>,
    pub deleted_at: Option<DateTime<Utc>>,
    /// Its place in the events' sequence: it receives the events after it (migrations/V22).
    pub created_sequence: Option<i64>,
    pub failing_since: Option<DateTime<Utc>>,
    /// The key of the request whose answer showed the current secret.
    pub secret_from_key: Option<String>,
}

/// An endpoint as its creation, rotation or enabling answers it: with its secret in clear
/// when the answer may show it.
#[derive(Clone, Debug)]
pub struct EndpointRow {
    pub id: EndpointId,
    pub url: String,
    pub events: Option<Vec<String>>,
    /// The secret this request made, in clear; `None` on a replay once the secret was rotated
    /// since (a replay never shows a secret other than its first answer's), and for `enable`.
    pub secret: Option<String>,
    pub created_at: DateTime<Utc>,
    /// Until when the previous secret also signs (after a rotation).
    pub previous_secret_expires_at: Option<DateTime<Utc>>,
    pub disabled_at: Option<DateTime<Utc>>,
    pub disabled_reason: Option<String>,
}

/// Registers an endpoint: `url` already checked ([`super::target`]), `events` already
/// validated against [`EVENT_TYPES`] (`None`: all).
pub struct CreateEndpoint {
    pub url: String,
    pub events: Option<Vec<String>>,
    pub sealer: Arc<SecretBox>,
    /// `ONCEPAY_WEBHOOK_MAX_ENDPOINTS`.
    pub max_endpoints: u32,
}

impl Effect for CreateEndpoint {
    const OPERATION: Operation = Operation::CreateWebhookEndpoint;
    type Row = EndpointRow;

    async fn run(
        &self,
        conn: &mut PgConnection,
        tenant: TenantId,
        claim: &ClaimArgs,
    ) -> Result<Outcome<EndpointRow>, sqlx::Error> {
        let sealed = self.sealer.seal(tenant.get(), &SecretBox::generate());
        let max = i32::try_from(self.max_endpoints).unwrap_or(i32::MAX);
        let r = sqlx::query!(
            r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                      resource AS "resource: StoredEndpoint"
               FROM oncepay_create_webhook_endpoint($1, $2, $3, $4, $5, $6)"#,
            tenant.get(),
            claim as _,
            self.url,
            self.events.as_deref() as Option<&[String]>,
            sealed,
            max,
        )
        .fetch_one(conn)
        .await?;
        let outcome = settle(r.outcome, r.decline, r.expires_at, r.resource)?;
        opened(tenant, claim, Secret::Made(&self.sealer), outcome)
    }
}

/// Whether an answer carries the endpoint's secret.
#[derive(Clone, Copy)]
enum Secret<'a> {
    /// The request made it (a creation, a rotation): shown on its first answer, and on its
    /// replays while it is still the endpoint's secret; decrypted with this box.
    Made(&'a SecretBox),
    /// Never (enabling).
    Hidden,
}

/// An outcome whose stored endpoint is shown, with its secret decrypted where the answer
/// shows it: a replay shows the secret only if the replayed request made the endpoint's
/// current one (`secret_from_key`; for an endpoint of before migrations/V22, a creation's
/// replay while it was never rotated) and the endpoint is not deleted, so that every replica
/// answers a replay alike and none shows a secret that request never showed, or one of an
/// endpoint that is gone.
fn opened(
    tenant: TenantId,
    claim: &ClaimArgs,
    secret: Secret<'_>,
    outcome: Outcome<StoredEndpoint>,
) -> Result<Outcome<EndpointRow>, sqlx::Error> {
    let open = |stored: StoredEndpoint, replayed: bool| -> Result<EndpointRow, sqlx::Error> {
        let sealer = match secret {
            Secret::Hidden => None,
            Secret::Made(sealer) if !replayed => Some(sealer),
            Secret::Made(sealer) => {
                let still_its = match (&stored.secret_from_key, claim.key()) {
                    (Some(made_by), Some(key)) => made_by == key,
                    (None, Some(key)) => {
                        stored.previous_secret_encrypted.is_none() && stored.idempotency_key.as_deref() == Some(key)
                    }
                    (_, None) => false,
                };
                // A deleted endpoint's secret signs nothing any more: no replay shows it.
                (still_its && stored.deleted_at.is_none()).then_some(sealer)
            }
        };
        let secret = match sealer {
            None => None,
            Some(sealer) => Some(
                sealer
                    .open(tenant.get(), &stored.secret_encrypted)
                    .map_err(|e| sqlx::Error::Decode(e.into()))?,
            ),
        };
        Ok(EndpointRow {
            id: EndpointId::from_uuid(stored.endpoint_id),
            url: stored.url,
            events: stored.event_types,
            secret,
            created_at: stored.created_at,
            previous_secret_expires_at: stored.previous_secret_expires_at,
            disabled_at: stored.disabled_at,
            disabled_reason: stored.disabled_reason,
        })
    };
    let result = match outcome.result {
        Ok(Reply::New(stored)) => Ok(Reply::New(open(stored, false)?)),
        Ok(Reply::Replayed(stored)) => Ok(Reply::Replayed(open(stored, true)?)),
        Err(refusal) => Err(refusal),
    };
    Ok(Outcome {
        result,
        expires_at: outcome.expires_at,
    })
}

/// Rotates an endpoint's secret: a new one signs from now on, the previous one as well
/// for `overlap` (receivers accept either of the two signatures meanwhile). A replay shows
/// the same secret while it is the endpoint's, none once it was rotated again.
pub struct RotateSecret {
    pub endpoint: EndpointId,
    pub overlap: std::time::Duration,
    pub sealer: Arc<SecretBox>,
}

impl Effect for RotateSecret {
    const OPERATION: Operation = Operation::RotateWebhookSecret;
    type Row = EndpointRow;

    async fn run(
        &self,
        conn: &mut PgConnection,
        tenant: TenantId,
        claim: &ClaimArgs,
    ) -> Result<Outcome<EndpointRow>, sqlx::Error> {
        let sealed = self.sealer.seal(tenant.get(), &SecretBox::generate());
        let overlap = i32::try_from(self.overlap.as_secs()).unwrap_or(i32::MAX);
        let r = sqlx::query!(
            r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                      resource AS "resource: StoredEndpoint"
               FROM oncepay_rotate_webhook_secret($1, $2, $3, $4, $5)"#,
            tenant.get(),
            claim as _,
            self.endpoint.get(),
            sealed,
            overlap,
        )
        .fetch_one(conn)
        .await?;
        let outcome = settle(r.outcome, r.decline, r.expires_at, r.resource)?;
        opened(tenant, claim, Secret::Made(&self.sealer), outcome)
    }
}

/// Enables an endpoint: it takes deliveries again, first the ones kept while it was disabled.
pub struct EnableEndpoint {
    pub endpoint: EndpointId,
}

impl Effect for EnableEndpoint {
    const OPERATION: Operation = Operation::EnableWebhookEndpoint;
    type Row = EndpointRow;

    async fn run(
        &self,
        conn: &mut PgConnection,
        tenant: TenantId,
        claim: &ClaimArgs,
    ) -> Result<Outcome<EndpointRow>, sqlx::Error> {
        let r = sqlx::query!(
            r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                      resource AS "resource: StoredEndpoint"
               FROM oncepay_enable_webhook_endpoint($1, $2, $3)"#,
            tenant.get(),
            claim as _,
            self.endpoint.get(),
        )
        .fetch_one(conn)
        .await?;
        let outcome = settle(r.outcome, r.decline, r.expires_at, r.resource)?;
        opened(tenant, claim, Secret::Hidden, outcome)
    }
}

/// An endpoint as `GET /webhook-endpoints` lists it (never its secret).
#[derive(Clone, Debug)]
pub struct ListedEndpoint {
    pub id: EndpointId,
    pub url: String,
    pub events: Option<Vec<String>>,
    pub created_at: DateTime<Utc>,
    pub disabled_at: Option<DateTime<Utc>>,
    pub disabled_reason: Option<String>,
}

/// The tenant's endpoints, deleted ones left out, oldest first.
pub async fn list(conn: &mut PgConnection, tenant: TenantId) -> Result<Vec<ListedEndpoint>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"SELECT endpoint_id, url, event_types, created_at, disabled_at, disabled_reason
             FROM webhook_endpoints
            WHERE tenant_id = $1 AND deleted_at IS NULL
            ORDER BY created_at, endpoint_id"#,
        tenant.get(),
    )
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| ListedEndpoint {
            id: EndpointId::from_uuid(r.endpoint_id),
            url: r.url,
            events: r.event_types,
            created_at: r.created_at,
            disabled_at: r.disabled_at,
            disabled_reason: r.disabled_reason,
        })
        .collect())
}

/// Deletes an endpoint (its pending and held deliveries are cancelled); `false` if the tenant
/// has no such endpoint (or it was deleted already).
pub async fn delete(conn: &mut PgConnection, tenant: TenantId, endpoint: EndpointId) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT oncepay_webhook_disable($1, $2, 'deleted') AS "deleted!""#,
        tenant.get(),
        endpoint.get(),
    )
    .fetch_one(conn)
    .await
}

/// An event as delivered.
#[derive(Clone, Debug)]
pub struct EventRow {
    pub id: EventId,
    pub event_type: String,
    pub data: serde_json::Value,
    pub created_at: DateTime<Utc>,
}

pub async fn event(conn: &mut PgConnection, tenant: TenantId, event: EventId) -> Result<Option<EventRow>, sqlx::Error> {
    let row = sqlx::query!(
        // A payment's event is stored without its data, rendered here (migrations/V18).
        r#"SELECT ev.event_id, ev.event_type, oncepay_event_data(ev) AS "data!", ev.created_at
             FROM webhook_events ev
            WHERE ev.tenant_id = $1 AND ev.event_id = $2"#,
        tenant.get(),
        event.get(),
    )
    .fetch_optional(conn)
    .await?;
    Ok(row.map(|r| EventRow {
        id: EventId::from_uuid(r.event_id),
        event_type: r.event_type,
        data: r.data,
        created_at: r.created_at,
    }))
}

impl EventRow {
    /// The body every attempt sends (Standard Webhooks: `{"type","timestamp","data"}`),
    /// the same bytes each time.
    pub fn body(&self) -> Vec<u8> {
        body(&self.event_type, self.created_at, &self.data)
    }
}

/// The delivered body of an event.
pub fn body(event_type: &str, created_at: DateTime<Utc>, data: &serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "type": event_type,
        "timestamp": created_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        "data": data,
    }))
    .expect("a JSON value serialises")
}
