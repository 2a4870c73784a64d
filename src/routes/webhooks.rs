//! `POST /webhook-endpoints`, `POST /webhook-endpoints/{id}/rotate-secret` and
//! `POST /webhook-endpoints/{id}/enable` (idempotent operations), `GET /webhook-endpoints`,
//! `DELETE /webhook-endpoints/{id}`, `GET /events/{id}` (docs/webhooks.md, docs/api.md).

use actix_web::{web, HttpRequest, HttpResponse};
use chrono::{DateTime, Utc};
use oncepay_protocol::routes;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::intake::{no_query, EmptyBody};
use super::pipeline::{route, Endpoint};
use super::schemas::{BadRequest, NotFound, Overloaded, Unauthorized, Unavailable};
use crate::domain::{time, EndpointId, EventId};
use crate::error::ApiError;
use crate::state::AppState;
use crate::webhooks::endpoints::{self, EVENT_TYPES};
use crate::webhooks::{target, CreateEndpoint, EnableEndpoint, EndpointRow, EventRow, RotateSecret};

pub fn configure(cfg: &mut web::ServiceConfig) {
    route::<CreateWebhookEndpoint>(cfg);
    route::<RotateWebhookSecret>(cfg);
    route::<EnableWebhookEndpoint>(cfg);
    cfg.route(routes::LIST_WEBHOOK_ENDPOINTS.path, super::get().to(list));
    cfg.route(routes::DELETE_WEBHOOK_ENDPOINT.path, web::delete().to(delete));
    cfg.route(routes::GET_EVENT.path, super::get().to(show_event));
}

/// Body of `POST /webhook-endpoints`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WebhookEndpointIn {
    /// Where events are POSTed: an `http` or `https` URL whose host resolves to public
    /// addresses only (unless the server allows private ones).
    pub url: String,
    /// The event types to receive (at least one); absent: every type, present and future.
    #[schema(example = json!(["payment.succeeded", "payment.refunded"]))]
    pub events: Option<Vec<String>>,
}

/// A new endpoint, with its signing secret (shown here only; a replay shows the same one,
/// or `null` once the secret was rotated).
#[derive(Serialize, ToSchema)]
pub struct WebhookEndpointOut {
    id: EndpointId,
    url: String,
    events: Vec<String>,
    /// `true` for an endpoint created without `events`: it takes every type, present and
    /// future, and `events` lists today's (found from outside: it read as these types by name).
    all_events: bool,
    /// `whsec_` + base64 of the HMAC key (Standard Webhooks); `null` on a replay after a
    /// rotation (a replay never shows a secret its first answer did not).
    secret: Option<String>,
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
}

/// Body of `POST /webhook-endpoints/{id}/rotate-secret` (`{}` or empty: the defaults).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RotateSecretIn {
    /// How long the previous secret keeps signing beside the new one, in seconds: 0 to
    /// 604800 (7 days); default 86400.
    pub overlap_secs: Option<u32>,
}

/// The endpoint with its new secret (shown here only).
#[derive(Serialize, ToSchema)]
pub struct RotatedSecretOut {
    id: EndpointId,
    /// The new `whsec_` secret; `null` on a replay once it was rotated again.
    secret: Option<String>,
    /// Until when the previous secret signs too; `null` on a replay once it was rotated
    /// again, as the secret (the endpoint then holds the later rotation's).
    #[serde(serialize_with = "time::rfc3339_opt")]
    previous_secret_expires_at: Option<DateTime<Utc>>,
}

/// An endpoint as listed: never its secret.
#[derive(Serialize, ToSchema)]
struct WebhookEndpointListed {
    id: EndpointId,
    url: String,
    events: Vec<String>,
    /// `true` for an endpoint created without `events`: it takes every type, present and
    /// future, and `events` lists today's (found from outside: it read as these types by name).
    all_events: bool,
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
    /// `enabled`, or `disabled` (410 Gone, or no attempt succeeded for
    /// `ONCEPAY_WEBHOOK_DISABLE_AFTER_SECS` while attempts kept failing; its events are kept
    /// until it is enabled again).
    status: &'static str,
    #[serde(serialize_with = "time::rfc3339_opt")]
    disabled_at: Option<DateTime<Utc>>,
    /// `gone` or `failing`.
    disabled_reason: Option<String>,
}

/// An event as delivered (its `id` is the `webhook-id`).
#[derive(Serialize, ToSchema)]
pub(super) struct EventOut {
    id: EventId,
    #[serde(rename = "type")]
    kind: String,
    timestamp: String,
    data: serde_json::Value,
}

impl super::lists::ListItem for EventOut {}

/// An endpoint enabled: as listed, as of that request (a replay answers the same).
#[derive(Serialize, ToSchema)]
pub struct EnabledEndpointOut {
    id: EndpointId,
    url: String,
    events: Vec<String>,
    /// `true` for an endpoint created without `events`: it takes every type, present and
    /// future, and `events` lists today's (found from outside: it read as these types by name).
    all_events: bool,
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
    /// `enabled`.
    status: &'static str,
}

fn events_or_all(events: Option<Vec<String>>) -> Vec<String> {
    events.unwrap_or_else(|| EVENT_TYPES.iter().map(|&t| t.to_owned()).collect())
}

pub struct CreateWebhookEndpoint;

impl Endpoint for CreateWebhookEndpoint {
    type Effect = CreateEndpoint;
    type In = WebhookEndpointIn;
    type Out = WebhookEndpointOut;
    const CACHES_REPLAYS: bool = false;

    fn effect(req: &HttpRequest, body: WebhookEndpointIn) -> Result<(CreateEndpoint, Option<String>), ApiError> {
        let state = req
            .app_data::<web::Data<AppState>>()
            .ok_or_else(|| ApiError::Internal(anyhow::anyhow!("no application state")))?;
        let url = target::parse(&body.url).map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
        if let Some(events) = &body.events {
            if events.is_empty() {
                return Err(ApiError::InvalidRequest(
                    "`events` must name at least one event type (omit it for all)".to_owned(),
                ));
            }
            if let Some(unknown) = events.iter().find(|e| !EVENT_TYPES.contains(&e.as_str())) {
                return Err(ApiError::InvalidRequest(format!(
                    "`events`: {unknown:?} is not one of {}",
                    EVENT_TYPES.join(", ")
                )));
            }
        }
        let sealer = state.webhook_secrets.clone();
        let mut events = body.events;
        if let Some(events) = &mut events {
            events.sort();
            events.dedup();
        }
        Ok((
            CreateEndpoint {
                url: url.to_string(),
                events,
                sealer,
                max_endpoints: state.settings.webhooks.max_endpoints,
            },
            None,
        ))
    }

    /// The host's addresses, looked up now (asynchronously and within
    /// [`target::LOOKUP_TIMEOUT`]: a name whose nameserver never answers holds no worker);
    /// deliveries check them again on every connection.
    async fn verify(req: &HttpRequest, effect: &CreateEndpoint) -> Result<(), ApiError> {
        let state = req
            .app_data::<web::Data<AppState>>()
            .ok_or_else(|| ApiError::Internal(anyhow::anyhow!("no application state")))?;
        let url = target::parse(&effect.url).map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
        target::check(&url, state.settings.webhooks.allow_private)
            .await
            .map_err(|e| ApiError::InvalidRequest(e.to_string()))
    }

    fn render(row: EndpointRow) -> Result<WebhookEndpointOut, ApiError> {
        Ok(WebhookEndpointOut {
            id: row.id,
            url: row.url,
            all_events: row.events.is_none(),
            events: events_or_all(row.events),
            secret: row.secret,
            created_at: row.created_at,
        })
    }
}

pub struct RotateWebhookSecret;

impl Endpoint for RotateWebhookSecret {
    type Effect = RotateSecret;
    type In = RotateSecretIn;
    type Out = RotatedSecretOut;
    const EMPTY_BODY: EmptyBody = EmptyBody::MeansEmptyObject;
    const CACHES_REPLAYS: bool = false;

    fn effect(req: &HttpRequest, body: RotateSecretIn) -> Result<(RotateSecret, Option<String>), ApiError> {
        let state = req
            .app_data::<web::Data<AppState>>()
            .ok_or_else(|| ApiError::Internal(anyhow::anyhow!("no application state")))?;
        let endpoint = req
            .match_info()
            .get("id")
            .and_then(EndpointId::parse)
            .ok_or(ApiError::NotFound)?;
        let overlap = body.overlap_secs.unwrap_or(86_400);
        if overlap > 604_800 {
            return Err(ApiError::InvalidRequest(
                "`overlap_secs` must be between 0 and 604800 (7 days)".to_owned(),
            ));
        }
        let sealer = state.webhook_secrets.clone();
        Ok((
            RotateSecret {
                endpoint,
                overlap: std::time::Duration::from_secs(overlap.into()),
                sealer,
            },
            Some(endpoint.to_string()),
        ))
    }

    fn render(row: EndpointRow) -> Result<RotatedSecretOut, ApiError> {
        // The row is the endpoint as it is now: a rotation's replay whose secret is no longer
        // the current one (hidden) would show the later rotation's expiry as its own.
        let previous_secret_expires_at = row.secret.as_ref().and(row.previous_secret_expires_at);
        Ok(RotatedSecretOut {
            id: row.id,
            secret: row.secret,
            previous_secret_expires_at,
        })
    }
}

pub struct EnableWebhookEndpoint;

impl Endpoint for EnableWebhookEndpoint {
    type Effect = EnableEndpoint;
    type In = EnableEndpointIn;
    type Out = EnabledEndpointOut;
    const EMPTY_BODY: EmptyBody = EmptyBody::MeansEmptyObject;

    fn effect(req: &HttpRequest, _body: EnableEndpointIn) -> Result<(EnableEndpoint, Option<String>), ApiError> {
        let endpoint = req
            .match_info()
            .get("id")
            .and_then(EndpointId::parse)
            .ok_or(ApiError::NotFound)?;
        Ok((EnableEndpoint { endpoint }, Some(endpoint.to_string())))
    }

    fn render(row: EndpointRow) -> Result<EnabledEndpointOut, ApiError> {
        Ok(EnabledEndpointOut {
            id: row.id,
            url: row.url,
            all_events: row.events.is_none(),
            events: events_or_all(row.events),
            created_at: row.created_at,
            status: "enabled",
        })
    }
}

/// Body of `POST /webhook-endpoints/{id}/enable`: `{}` or empty.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EnableEndpointIn {}

/// The tenant's webhook endpoints (deleted ones left out), never their secrets.
#[utoipa::path(
    get, path = "/webhook-endpoints", tag = "webhooks", operation_id = "list_webhook_endpoints", security(("api_key" = [])),
    responses(
        (status = 200, description = "The endpoints, oldest first.", body = [WebhookEndpointListed]),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized), (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn list(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let tenant = state.tenant(&req).await?;
    no_query(&req)?;
    let mut conn = state.conn().await?;
    let rows = conn.run(async |c| endpoints::list(c, tenant.id).await).await?;
    let listed: Vec<_> = rows
        .into_iter()
        .map(|e| WebhookEndpointListed {
            id: e.id,
            url: e.url,
            all_events: e.events.is_none(),
            events: events_or_all(e.events),
            created_at: e.created_at,
            status: if e.disabled_at.is_some() { "disabled" } else { "enabled" },
            disabled_at: e.disabled_at,
            disabled_reason: e.disabled_reason,
        })
        .collect();
    Ok(HttpResponse::Ok().json(listed))
}

/// Deletes an endpoint: nothing more is sent to it, its pending deliveries are cancelled.
#[utoipa::path(
    delete, path = "/webhook-endpoints/{id}", tag = "webhooks", operation_id = "delete_webhook_endpoint", security(("api_key" = [])),
    params(("id" = EndpointId, Path, description = "The endpoint's id; another tenant's answers 404.")),
    responses(
        (status = 204, description = "Deleted."),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized), (status = 404, response = NotFound),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn delete(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let tenant = state.tenant(&req).await?;
    no_query(&req)?;
    let id = req
        .match_info()
        .get("id")
        .and_then(EndpointId::parse)
        .ok_or(ApiError::NotFound)?;
    let mut conn = state.conn().await?;
    if conn.run(async |c| endpoints::delete(c, tenant.id, id).await).await? {
        Ok(HttpResponse::NoContent().finish())
    } else {
        Err(ApiError::NotFound)
    }
}

/// An event as delivered (kept `ONCEPAY_EVENT_RETENTION_DAYS`, delivered or not).
#[utoipa::path(
    get, path = "/events/{id}", tag = "webhooks", operation_id = "get_event", security(("api_key" = [])),
    params(("id" = EventId, Path, description = "The event's id (its `webhook-id`); another tenant's answers 404.")),
    responses(
        (status = 200, description = "The event: `type`, `timestamp` and `data` as in the delivered body.", body = EventOut),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized), (status = 404, response = NotFound),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn show_event(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let tenant = state.tenant(&req).await?;
    no_query(&req)?;
    let id = req
        .match_info()
        .get("id")
        .and_then(EventId::parse)
        .ok_or(ApiError::NotFound)?;
    let mut conn = state.conn().await?;
    let event = conn
        .run(async |c| endpoints::event(c, tenant.id, id).await)
        .await?
        .ok_or(ApiError::NotFound)?;
    Ok(HttpResponse::Ok().json(EventOut::from(event)))
}

impl From<EventRow> for EventOut {
    fn from(event: EventRow) -> Self {
        Self {
            id: event.id,
            kind: event.event_type,
            timestamp: event.created_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            data: event.data,
        }
    }
}
