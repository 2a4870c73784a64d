//! `POST /accounts/{id}/top-ups`, `GET /top-ups/{id}`, `POST /top-ups/{id}/refund`: card
//! top-ups through the processor (contract section 4b; `crate::topup` drives the phases).
//!
//! These two operations do not go through the one-statement pipeline: a top-up spans
//! several transactions with processor calls between them. Intake is the pipeline's (the
//! same checks in the same order, the same fingerprint and claim); what differs is the answer
//! to an unknown outcome (503 and the key stays with the operation) and the `decline_code` of
//! a card decline. Their answers are not kept in the replay cache: a top-up is rare next to a
//! payment, and its replay is one cheap statement.

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use chrono::{DateTime, Utc};
use oncepay_protocol::routes;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::intake::{parse_body, read_body, EmptyBody};
use super::lists::{self, Filter, ListOut};
use super::schemas::{
    BadRequest, BodyTooLarge, Conflict, IdempotencyKeyHeader, KeyRefused, NotFound, Overloaded, PaymentRequired,
    ProcessorNotConfigured, Unauthorized, Unavailable, UnsupportedMediaType,
};
use crate::domain::{AccountId, Amount, TopUpId};
use crate::error::{ApiError, REPLAYED_HEADER};
use crate::idempotency::{self, IdempotencyKey};
use crate::ledger::top_ups::NewTopUp;
use crate::ledger::{self, ClaimArgs, TopUpRow};
use crate::operation::Operation;
use crate::state::AppState;
use crate::telemetry::RequestOutcome;
use crate::topup::{Answer, TopUpError, TopUps};

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route(routes::CREATE_TOP_UP.path, web::post().to(create));
    cfg.route(routes::GET_TOP_UP.path, web::get().to(show));
    cfg.route(routes::REFUND_TOP_UP.path, web::post().to(refund));
    cfg.route(routes::LIST_TOP_UPS.path, web::get().to(list));
}

/// Longest payment method id accepted (Stripe's are about 30 characters).
const MAX_PAYMENT_METHOD_LEN: usize = 255;

/// Body of `POST /accounts/{id}/top-ups`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TopUpIn {
    pub amount: Amount,
    /// The processor's payment method (`pm_...`).
    #[schema(min_length = 1, max_length = 255, pattern = "^[!-~]+$")]
    pub payment_method: String,
}

/// A top-up, as of its success.
#[derive(Serialize, ToSchema)]
pub struct TopUpOut {
    id: TopUpId,
    account: String,
    amount: i64,
    currency: String,
    /// Always `succeeded` here: a top-up is answered when it is final.
    status: &'static str,
    /// The processor's PaymentIntent.
    processor_payment_id: Option<String>,
    /// The account's balance right after this top-up.
    balance: i64,
    created_at: DateTime<Utc>,
}

/// A top-up's current state (the same fields as its events' `data`: migrations/V23,
/// `oncepay_top_up_event_data`).
#[derive(Serialize, ToSchema)]
pub struct TopUpStateOut {
    id: TopUpId,
    account: String,
    amount: i64,
    currency: String,
    /// `processing`, `succeeded`, `failed`, `refund_pending` (a refund's debit is made, the
    /// processor's refund not finished) or `refunded`.
    status: String,
    processor_payment_id: Option<String>,
    /// The PaymentIntent's status when oncepay last looked: while the top-up is `processing`,
    /// what it waits for (`requires_action`, `requires_capture`, `processing`).
    processor_status: Option<String>,
    /// Why a failed top-up failed: `card_declined`, `invalid_payment_method`,
    /// `invalid_request`, `authentication_required`, `capture_required` or `canceled`.
    failure_code: Option<String>,
    /// The processor's own reason (its `decline_code` or error `code`).
    decline_code: Option<String>,
    /// Why the last refund failed; its amount was credited back.
    refund_failure_code: Option<String>,
    created_at: DateTime<Utc>,
}

/// A refunded top-up, or one whose refund is pending at the processor.
#[derive(Serialize, ToSchema)]
pub struct TopUpRefundOut {
    id: TopUpId,
    /// `refunded` (200), or `refund_pending` (202: `GET /top-ups/{id}` shows how it ends).
    status: &'static str,
    /// The amount refunded (the whole top-up).
    refunded: i64,
    /// The account's balance right after the refund's debit.
    balance: i64,
}

/// Empty body of `POST /top-ups/{id}/refund`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TopUpRefundIn {}

/// The checks of the pipeline's intake, in its order: authentication, body, key, body
/// again (parsed), then the claim. Gives the tenant, the parsed body and the claim's
/// arguments for the canonical path `path`.
async fn intake<T: serde::de::DeserializeOwned>(
    req: &HttpRequest,
    payload: web::Payload,
    state: &AppState,
    operation: Operation,
    id: Option<&str>,
    empty: EmptyBody,
) -> Result<(crate::tenants::Tenant, T, ClaimArgs, bool), ApiError> {
    let spec = operation.spec();
    let tenant = state.tenant(req).await?;
    let bytes = read_body(req, payload, state.settings.max_body_bytes).await?;
    let key = IdempotencyKey::from_headers(req.headers()).map_err(ApiError::InvalidIdempotencyKey)?;
    let key = idempotency::key_or_policy(key, tenant.policy)?;
    let (body, input) = parse_body::<T>(&bytes, empty)?;
    let path = id.map_or_else(|| spec.path.to_owned(), |id| spec.path_with(id));
    let fingerprint = idempotency::fingerprint(spec.method, &path, &body);
    let claim = idempotency::claim_for(key, tenant.policy, fingerprint, state.windows());
    if claim.is_none() {
        tracing::warn!(tenant = %tenant.id, path, "keyless request processed without idempotency protection (policy allow)");
    }
    let keyed = claim.is_some();
    let args = ClaimArgs::new(spec, path, claim.as_ref(), state.settings.inflight_wait);
    Ok((tenant, input, args, keyed))
}

fn processor(state: &AppState) -> Result<&TopUps, ApiError> {
    state.top_ups.as_ref().ok_or(ApiError::ProcessorNotConfigured)
}

/// Charges a card at the processor and credits the account by the same amount.
#[utoipa::path(
    post, path = "/accounts/{id}/top-ups", tag = "top-ups", operation_id = "create_top_up",
    security(("api_key" = [])),
    params(IdempotencyKeyHeader, ("id" = AccountId, Path, description = "The account to credit.")),
    request_body(content = TopUpIn, content_type = "application/json"),
    responses(
        (status = 201, description = "The card was charged and the account credited (or the replay of that answer).",
         body = TopUpOut, headers(("Location" = String, description = "/top-ups/{id}"),
                                  ("Idempotency-Replayed" = String, description = "`true` on a replay"))),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 402, response = PaymentRequired), (status = 404, response = NotFound),
        (status = 409, response = Conflict), (status = 413, response = BodyTooLarge),
        (status = 415, response = UnsupportedMediaType), (status = 422, response = KeyRefused),
        (status = 429, response = Overloaded), (status = 501, response = ProcessorNotConfigured),
        (status = 503, response = Unavailable),
    )
)]
pub(super) async fn create(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let account_raw = req.match_info().get("id").unwrap_or_default().to_owned();
    let (tenant, input, claim, keyed) = intake::<TopUpIn>(
        &req,
        payload,
        &state,
        Operation::TopUp,
        Some(&account_raw),
        EmptyBody::Refused,
    )
    .await?;
    let account = AccountId::parse(&account_raw).map_err(ApiError::InvalidRequest)?;
    if input.payment_method.is_empty()
        || input.payment_method.len() > MAX_PAYMENT_METHOD_LEN
        || !input.payment_method.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(ApiError::InvalidRequest(
            "`payment_method`: 1 to 255 visible ASCII characters".to_owned(),
        ));
    }
    let top_ups = processor(&state)?.clone();
    // Driven in a task of its own: a client that hangs up does not stop the top-up between
    // two phases (its lease would keep a retry waiting until it expires).
    let answer = tokio::spawn(async move {
        let new = NewTopUp {
            account: &account,
            amount: input.amount,
            currency: top_ups.currency(),
            payment_method: &input.payment_method,
            processor: top_ups.processor(),
        };
        top_ups.create(tenant.id, &claim, &new).await
    })
    .await
    .map_err(|e| ApiError::Internal(e.into()))?
    .map_err(edge)?;
    respond(answer, keyed, |row| {
        let out = TopUpOut {
            id: TopUpId::from_uuid(row.top_up_id),
            account: row.account_id.0.clone(),
            amount: row.amount.0,
            currency: row.currency.clone(),
            status: "succeeded",
            processor_payment_id: row.processor_payment_id.clone(),
            balance: row
                .balance_after
                .ok_or_else(|| super::pipeline::corrupt("a succeeded top-up without its balance"))?,
            created_at: row.created_at,
        };
        Ok((
            StatusCode::CREATED,
            body(&out)?,
            Some(routes::GET_TOP_UP.with_id(&out.id.to_string())),
        ))
    })
}

/// Debits the top-up's amount, then refunds the card at the processor.
#[utoipa::path(
    post, path = "/top-ups/{id}/refund", tag = "top-ups", operation_id = "refund_top_up",
    security(("api_key" = [])),
    params(IdempotencyKeyHeader, ("id" = TopUpId, Path, description = "The top-up; another tenant's answers 404.")),
    request_body(content = TopUpRefundIn, content_type = "application/json"),
    responses(
        (status = 200, description = "Refunded (or the replay of that answer).", body = TopUpRefundOut),
        (status = 202, description = "Debited; the processor's refund is pending (`refund_pending`): a retry with the same key looks again, `GET /top-ups/{id}` and the events tell how it ends.", body = TopUpRefundOut),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 402, response = PaymentRequired), (status = 404, response = NotFound),
        (status = 409, response = Conflict), (status = 413, response = BodyTooLarge),
        (status = 415, response = UnsupportedMediaType), (status = 422, response = KeyRefused),
        (status = 429, response = Overloaded), (status = 501, response = ProcessorNotConfigured),
        (status = 503, response = Unavailable),
    )
)]
pub(super) async fn refund(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let raw = req.match_info().get("id").unwrap_or_default().to_owned();
    let (tenant, _input, claim, keyed) = intake::<TopUpRefundIn>(
        &req,
        payload,
        &state,
        Operation::RefundTopUp,
        Some(&raw),
        EmptyBody::MeansEmptyObject,
    )
    .await?;
    // An id that is no UUID names no top-up: 404 before anything is claimed.
    let id = TopUpId::parse(&raw).ok_or(ApiError::NotFound)?;
    let top_ups = processor(&state)?.clone();
    let answer = tokio::spawn(async move { top_ups.refund(tenant.id, &claim, id).await })
        .await
        .map_err(|e| ApiError::Internal(e.into()))?
        .map_err(edge)?;
    respond(answer, keyed, |row| {
        let pending = row.refund_debited();
        let out = TopUpRefundOut {
            id: TopUpId::from_uuid(row.top_up_id),
            status: if pending { "refund_pending" } else { "refunded" },
            refunded: row.amount.0,
            balance: row
                .balance_after_refund
                .ok_or_else(|| super::pipeline::corrupt("a refunded top-up without its balance"))?,
        };
        let status = if pending { StatusCode::ACCEPTED } else { StatusCode::OK };
        Ok((status, body(&out)?, None))
    })
}

/// A top-up's current state.
#[utoipa::path(
    get, path = "/top-ups/{id}", tag = "top-ups", operation_id = "get_top_up", security(("api_key" = [])),
    params(("id" = TopUpId, Path, description = "The top-up's id; another tenant's answers 404.")),
    responses(
        (status = 200, description = "The top-up.", body = TopUpStateOut),
        (status = 401, response = Unauthorized), (status = 404, response = NotFound),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn show(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let tenant = state.tenant(&req).await?;
    let id = TopUpId::parse(req.match_info().get("id").unwrap_or_default()).ok_or(ApiError::NotFound)?;
    let mut conn = state.conn().await?;
    let row = conn
        .run(async |c| ledger::top_ups::top_up(c, tenant.id, id).await)
        .await?
        .ok_or(ApiError::NotFound)?;
    Ok(HttpResponse::Ok().json(TopUpStateOut::from(row)))
}

impl From<TopUpRow> for TopUpStateOut {
    fn from(row: TopUpRow) -> Self {
        Self {
            id: TopUpId::from_uuid(row.top_up_id),
            status: row.shown_status().to_owned(),
            account: row.account_id.0,
            amount: row.amount.0,
            currency: row.currency,
            processor_payment_id: row.processor_payment_id,
            processor_status: row.processor_status,
            failure_code: row.failure_code,
            decline_code: row.decline_code,
            refund_failure_code: row.refund_failure_code,
            created_at: row.created_at,
        }
    }
}

/// The statuses `GET /top-ups/{id}` shows (`oncepay_top_up_status`, migrations/V8, and
/// `refund_pending`, V23), which `GET /top-ups` filters by.
const STATUSES: &[&str] = &["processing", "succeeded", "failed", "refund_pending", "refunded"];

const LIST_FILTERS: &[Filter] = &[Filter::Status(STATUSES)];

/// The query parameters of `GET /top-ups`.
pub(super) struct TopUpListParams;

impl utoipa::IntoParams for TopUpListParams {
    fn into_params(
        _: impl Fn() -> Option<utoipa::openapi::path::ParameterIn>,
    ) -> Vec<utoipa::openapi::path::Parameter> {
        lists::parameters(LIST_FILTERS)
    }
}

/// The tenant's top-ups, newest first (contract section 4d).
#[utoipa::path(
    get, path = "/top-ups", tag = "top-ups", operation_id = "list_top_ups", security(("api_key" = [])),
    params(TopUpListParams),
    responses(
        (status = 200, description = "A page of top-ups, each as `GET /top-ups/{id}` shows it.", body = ListOut<TopUpStateOut>),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn list(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let tenant = state.tenant(&req).await?;
    let (page, filters) = lists::query(&req, LIST_FILTERS, TopUpId::parse)?;
    let mut conn = state.conn().await?;
    let page = conn
        .run(async |c| ledger::lists::top_ups(c, tenant.id, filters.status.as_deref(), &page).await)
        .await?
        .ok_or_else(lists::unknown_cursor)?;
    Ok(lists::answer(
        routes::LIST_TOP_UPS.path.to_owned(),
        page.map(TopUpStateOut::from),
    ))
}

/// The answer's status, body (its fields in declaration order, as every answer) and
/// `Location`.
type Rendered = (StatusCode, Vec<u8>, Option<String>);

fn body<T: Serialize>(out: &T) -> Result<Vec<u8>, ApiError> {
    serde_json::to_vec(out).map_err(|e| ApiError::Internal(e.into()))
}

fn respond(
    answer: Answer,
    keyed: bool,
    render: impl FnOnce(&TopUpRow) -> Result<Rendered, ApiError>,
) -> Result<HttpResponse, ApiError> {
    match answer {
        Answer::Done { row, replayed } => {
            let (status, body, location) = render(&row)?;
            let mut response = HttpResponse::build(status);
            if keyed {
                response.insert_header((REPLAYED_HEADER, if replayed { "true" } else { "false" }));
            }
            if let Some(location) = location {
                response.insert_header((header::LOCATION, location));
            }
            let mut response = response.content_type(mime::APPLICATION_JSON).body(body);
            let label = match (replayed, keyed) {
                (true, _) => "replayed",
                (false, true) => "created",
                (false, false) => "keyless",
            };
            response.extensions_mut().insert(RequestOutcome(label));
            Ok(response)
        }
        Answer::RefundPending { row } => {
            let (status, body, _) = render(&row)?;
            let mut response = HttpResponse::build(status);
            if keyed {
                // Not final: a retry with the key looks at the refund again.
                response.insert_header((REPLAYED_HEADER, "false"));
            }
            let mut response = response.content_type(mime::APPLICATION_JSON).body(body);
            // The debit was made: counted as made, not yet as refunded.
            response
                .extensions_mut()
                .insert(RequestOutcome(if keyed { "created" } else { "keyless" }));
            Ok(response)
        }
        Answer::Declined { decline, row, replayed } => Err(ApiError::ProcessorDeclined {
            decline,
            decline_code: row.and_then(|r| r.decline_code),
            replayed,
        }),
        Answer::KeyReused => Err(ApiError::KeyReused),
        Answer::KeyExpired => Err(ApiError::KeyExpired),
    }
}

fn edge(err: TopUpError) -> ApiError {
    match err {
        TopUpError::Db(err) => err.into(),
        TopUpError::ProcessorUnknown(why) => {
            tracing::warn!(
                why,
                "top-up answered 503: the processor's outcome is unknown, the key stays with it"
            );
            ApiError::ProcessorUnknown
        }
        TopUpError::Waiting(status) => {
            tracing::info!(
                status,
                "top-up answered 503: its PaymentIntent waits at the processor, the key stays with it"
            );
            ApiError::ProcessorUnknown
        }
        TopUpError::InProgress => ApiError::InProgress,
    }
}
