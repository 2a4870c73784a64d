//! The event log and delivery made visible and repairable (docs/webhooks.md, "Delivering again"): `GET /events`,
//! `GET /webhook-endpoints/{id}/attempts`, and the idempotent operations
//! `POST /webhook-endpoints/{id}/events/{event_id}/resend` and
//! `POST /webhook-endpoints/{id}/recover` (`POST /webhook-endpoints/{id}/enable` is in
//! `webhooks`).

use actix_web::{web, HttpRequest, HttpResponse};
use chrono::{DateTime, TimeZone, Utc};
use oncepay_protocol::routes;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::intake::EmptyBody;
use super::lists::{self, Filter, ListOut};
use super::pipeline::{route, Endpoint};
use super::schemas::{BadRequest, NotFound, Overloaded, Unauthorized, Unavailable};
use super::webhooks::EventOut;
use crate::db::DbError;
use crate::domain::{time, AttemptId, EndpointId, EventId, TenantId};
use crate::error::ApiError;
use crate::ledger::{self, ClaimArgs, Effect as _, Outcome};
use crate::operation::Spec;
use crate::state::{AppState, WorkerLists};
use crate::webhooks::endpoints::EVENT_TYPES;
use crate::webhooks::recovery::{self, AttemptOutcome, AttemptsRefused, Recover, RecoveryRow, Resend, Resent};

pub fn configure(cfg: &mut web::ServiceConfig) {
    route::<ResendWebhookEvent>(cfg);
    route::<RecoverWebhookEndpoint>(cfg);
    cfg.route(routes::LIST_EVENTS.path, super::get().to(list_events));
    cfg.route(routes::LIST_WEBHOOK_ATTEMPTS.path, super::get().to(list_attempts));
}

fn endpoint_id(req: &HttpRequest) -> Result<EndpointId, ApiError> {
    req.match_info()
        .get("id")
        .and_then(EndpointId::parse)
        .ok_or(ApiError::NotFound)
}

/// Body of `POST /webhook-endpoints/{id}/events/{event_id}/resend`: `{}` or empty.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResendIn {}

/// A resend accepted: the event goes to the endpoint once more (as of that request; a replay
/// answers the same).
#[derive(Serialize, ToSchema)]
pub struct ResentOut {
    endpoint_id: EndpointId,
    /// The event, sent with it as its `webhook-id`.
    event_id: EventId,
}

pub struct ResendWebhookEvent;

impl Endpoint for ResendWebhookEvent {
    type Effect = Resend;
    type In = ResendIn;
    type Out = ResentOut;
    const EMPTY_BODY: EmptyBody = EmptyBody::MeansEmptyObject;

    fn effect(req: &HttpRequest, _body: ResendIn) -> Result<(Resend, Option<String>), ApiError> {
        let endpoint = endpoint_id(req)?;
        let event = req
            .match_info()
            .get("event_id")
            .and_then(EventId::parse)
            .ok_or(ApiError::NotFound)?;
        Ok((Resend { endpoint, event }, Some(endpoint.to_string())))
    }

    /// Both parameters, as parsed (so that two spellings of one id are one request).
    fn path(spec: &Spec, _id: Option<String>, effect: &Resend) -> String {
        spec.path_with_all(&[&effect.endpoint.to_string(), &effect.event.to_string()])
    }

    fn render(row: Resent) -> Result<ResentOut, ApiError> {
        Ok(ResentOut {
            endpoint_id: row.endpoint,
            event_id: row.event,
        })
    }
}

/// Body of `POST /webhook-endpoints/{id}/recover`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RecoverIn {
    /// Unix seconds: the events created since then are recovered.
    #[schema(minimum = 0, maximum = 253_402_300_799_i64)]
    pub since: i64,
}

/// A recovery: the deliveries it made due again (as of that request; a replay answers the
/// same).
#[derive(Serialize, ToSchema)]
pub struct RecoveryOut {
    id: uuid::Uuid,
    endpoint_id: EndpointId,
    #[serde(serialize_with = "time::rfc3339")]
    since: DateTime<Utc>,
    /// Deliveries made due now, each with a new retry schedule: those given up (or cancelled)
    /// reopened, and those waiting for a retry. For a disabled endpoint they wait, held, until
    /// it is enabled.
    deliveries: i32,
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
}

/// The latest `since` accepted: 9999-12-31T23:59:59Z.
const MAX_UNIX_SECONDS: i64 = 253_402_300_799;

pub struct RecoverWebhookEndpoint;

impl Endpoint for RecoverWebhookEndpoint {
    type Effect = Recover;
    type In = RecoverIn;
    type Out = RecoveryOut;

    fn effect(req: &HttpRequest, body: RecoverIn) -> Result<(Recover, Option<String>), ApiError> {
        let endpoint = endpoint_id(req)?;
        let since = (0..=MAX_UNIX_SECONDS)
            .contains(&body.since)
            .then(|| Utc.timestamp_opt(body.since, 0).single())
            .flatten()
            .ok_or_else(|| {
                ApiError::InvalidRequest(format!(
                    "`since` must be a time in Unix seconds, 0 to {MAX_UNIX_SECONDS}"
                ))
            })?;
        Ok((
            Recover {
                endpoint,
                since,
                prior: 0,
            },
            Some(endpoint.to_string()),
        ))
    }

    /// The slices first, unless the key is stored already (a replay changes nothing), then
    /// the keyed transaction.
    async fn execute(
        state: &AppState,
        tenant: TenantId,
        claim: ClaimArgs,
        mut recover: Recover,
    ) -> Result<Outcome<RecoveryRow>, DbError> {
        let mut conn = state.conn().await?;
        let stored = match claim.key() {
            Some(key) => conn.run(async |c| ledger::key(c, tenant, key).await).await?.is_some(),
            None => false,
        };
        if !stored {
            let started = std::time::Instant::now();
            let done = recover
                .run_slices(&mut conn, tenant, &claim, state.settings.webhooks.recovery_slice)
                .await?;
            if done.slices > 2 {
                tracing::info!(%tenant, endpoint = %recover.endpoint, slices = done.slices,
                    deliveries = done.deliveries, elapsed_ms = started.elapsed().as_millis() as u64,
                    "recovery: slices done, its keyed transaction next");
            }
        }
        conn.run(async |c| recover.run(c, tenant, &claim).await).await
    }

    fn render(row: RecoveryRow) -> Result<RecoveryOut, ApiError> {
        Ok(RecoveryOut {
            id: row.recovery_id,
            endpoint_id: EndpointId::from_uuid(row.endpoint_id),
            since: row.since,
            deliveries: row.deliveries,
            created_at: row.created_at,
        })
    }
}

const EVENT_FILTERS: &[Filter] = &[Filter::Type(&EVENT_TYPES)];

/// The query parameters of `GET /events`.
pub(super) struct EventListParams;

impl utoipa::IntoParams for EventListParams {
    fn into_params(
        _: impl Fn() -> Option<utoipa::openapi::path::ParameterIn>,
    ) -> Vec<utoipa::openapi::path::Parameter> {
        lists::parameters(EVENT_FILTERS)
    }
}

/// The tenant's events, newest first, kept `ONCEPAY_EVENT_RETENTION_DAYS` (30) whether
/// delivered or not. An event is written while an endpoint of the tenant (enabled or disabled)
/// subscribes to its type: a tenant without one has none.
#[utoipa::path(
    get, path = "/events", tag = "webhooks", operation_id = "list_events", security(("api_key" = [])),
    params(EventListParams),
    responses(
        (status = 200, description = "A page of events, each as `GET /events/{id}` shows it.", body = ListOut<EventOut>),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn list_events(
    req: HttpRequest,
    state: web::Data<AppState>,
    pool: web::Data<WorkerLists>,
) -> Result<HttpResponse, ApiError> {
    let tenant = state.tenant(&req).await?;
    let (page, filters) = lists::query(&req, EVENT_FILTERS, EventId::parse)?;
    let mut conn = state.list_conn(&pool).await?;
    let page = conn
        .run(async |c| recovery::events(c, tenant.id, filters.event_type.as_deref(), &page).await)
        .await?
        .ok_or_else(|| lists::unknown_cursor(&page))?;
    Ok(lists::answer(
        routes::LIST_EVENTS.path.to_owned(),
        page.map(EventOut::from),
    ))
}

/// One attempt to deliver an event to the endpoint.
#[derive(Serialize, ToSchema)]
pub(super) struct AttemptOut {
    id: AttemptId,
    /// The event (its `webhook-id`).
    event_id: EventId,
    #[serde(serialize_with = "time::rfc3339")]
    attempted_at: DateTime<Utc>,
    /// The receiver's HTTP status; `null` when none came (see `error`).
    status: Option<i16>,
    /// Why no 2xx came when there is no status to say it (a timeout, a refused or cut
    /// connection); `null` otherwise.
    error: Option<String>,
    /// From the start of the attempt to its answer (or its failure).
    latency_ms: i32,
}

impl super::lists::ListItem for AttemptOut {}

const ATTEMPT_FILTERS: &[Filter] = &[Filter::Outcome];

/// The query parameters of `GET /webhook-endpoints/{id}/attempts`.
pub(super) struct AttemptListParams;

impl utoipa::IntoParams for AttemptListParams {
    fn into_params(
        _: impl Fn() -> Option<utoipa::openapi::path::ParameterIn>,
    ) -> Vec<utoipa::openapi::path::Parameter> {
        let mut params = vec![utoipa::openapi::path::ParameterBuilder::new()
            .name("id")
            .parameter_in(utoipa::openapi::path::ParameterIn::Path)
            .required(utoipa::openapi::Required::True)
            .schema(Some(
                utoipa::openapi::schema::ObjectBuilder::new().schema_type(utoipa::openapi::schema::Type::String),
            ))
            .description(Some(
                "The endpoint's id; another tenant's, or a deleted one, answers 404.",
            ))
            .build()];
        params.extend(lists::parameters(ATTEMPT_FILTERS));
        params
    }
}

/// The endpoint's delivery attempts, newest first (kept as long as their events).
#[utoipa::path(
    get, path = "/webhook-endpoints/{id}/attempts", tag = "webhooks", operation_id = "list_webhook_attempts",
    security(("api_key" = [])),
    params(AttemptListParams),
    responses(
        (status = 200, description = "A page of attempts.", body = ListOut<AttemptOut>),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 404, response = NotFound), (status = 429, response = Overloaded),
        (status = 503, response = Unavailable),
    )
)]
pub(super) async fn list_attempts(
    req: HttpRequest,
    state: web::Data<AppState>,
    pool: web::Data<WorkerLists>,
) -> Result<HttpResponse, ApiError> {
    let tenant = state.tenant(&req).await?;
    let endpoint = endpoint_id(&req)?;
    let (page, filters) = lists::query(&req, ATTEMPT_FILTERS, AttemptId::parse)?;
    let outcome = filters.outcome.as_deref().and_then(AttemptOutcome::parse);
    let mut conn = state.list_conn(&pool).await?;
    let page = conn
        .run(async |c| recovery::attempts(c, tenant.id, endpoint, outcome, &page).await)
        .await?
        .map_err(|refused| match refused {
            AttemptsRefused::UnknownEndpoint => ApiError::NotFound,
            AttemptsRefused::UnknownCursor => lists::unknown_cursor(&page),
        })?;
    let url = routes::LIST_WEBHOOK_ATTEMPTS.with_id(&endpoint.to_string());
    Ok(lists::answer(
        url,
        page.map(|a| AttemptOut {
            id: a.id,
            event_id: a.id.event,
            attempted_at: a.attempted_at,
            status: a.status,
            error: a.error,
            latency_ms: a.latency_ms,
        }),
    ))
}
