//! `POST /accounts/{id}/top-ups`, `GET /top-ups/{id}`, `POST /top-ups/{id}/refund`: card
//! top-ups through the processor (docs/top-ups.md; `crate::top_ups` drives the phases).
//!
//! These two operations do not go through the one-statement pipeline: a top-up spans
//! several transactions with processor calls between them. Their intake and their answers'
//! headers are the pipeline's (`pipeline::intake`, `pipeline::answer`); what differs is the
//! answer to an unknown outcome (503 and the key stays with the operation) and the
//! `decline_code` of a card decline. Their answers are not kept in the replay cache: a top-up is rare next to a
//! payment, and its replay is one cheap statement.

use actix_web::http::StatusCode;
use actix_web::web::Bytes;
use actix_web::{web, HttpRequest, HttpResponse};
use chrono::{DateTime, Utc};
use oncepay_protocol::routes;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::intake::{no_query, EmptyBody};
use super::lists::{self, Filter, ListOut};
use super::pipeline::{self, intake, json_body, Intake, Replay};
use super::schemas::{
    BadRequest, BodyTooLarge, Conflict, IdempotencyKeyHeader, KeyRefused, NotFound, Overloaded, PaymentRequired,
    ProcessorNotConfigured, Unauthorized, Unavailable, UnsupportedMediaType,
};
use crate::domain::{time, AccountId, Amount, TenantId, TopUpId};
use crate::error::ApiError;
use crate::ledger::top_ups::NewTopUp;
use crate::ledger::{self, ClaimArgs, TopUpRow};
use crate::operation::{Operation, Spec};
use crate::state::{AppState, WorkerLists};
use crate::top_ups::{Answer, TopUpError, TopUps};

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route(routes::CREATE_TOP_UP.path, web::post().to(create));
    cfg.route(routes::GET_TOP_UP.path, super::get().to(show));
    cfg.route(routes::REFUND_TOP_UP.path, web::post().to(refund));
    cfg.route(routes::LIST_TOP_UPS.path, super::get().to(list));
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
    #[serde(serialize_with = "time::rfc3339")]
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
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
}

impl super::lists::ListItem for TopUpStateOut {}

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

/// Who answers a top-up request on this replica.
enum Answerer<'a> {
    /// The card processor, through the replica's top-ups.
    Processor(&'a TopUps),
    /// No processor here, and the key's answer is stored: its replay.
    Stored(Box<Answer>),
}

/// The replica's top-ups, or, without a card processor, the stored answer of a retry (a
/// replay needs no processor: found from outside, a finished top-up replayed through such a
/// replica answered 501, final to a client, though the card was charged), else 501.
async fn processor_or_stored<'a>(
    state: &'a AppState,
    tenant: TenantId,
    args: &ClaimArgs,
    refund: bool,
) -> Result<Answerer<'a>, ApiError> {
    if let Some(top_ups) = &state.top_ups {
        return Ok(Answerer::Processor(top_ups));
    }
    let mut conn = state.conn().await?;
    let stored = conn
        .run(async |c| ledger::top_ups::stored(c, tenant, args).await)
        .await?
        .ok_or(ApiError::ProcessorNotConfigured)?;
    crate::top_ups::stored_answer(stored, refund)
        .map(|answer| Answerer::Stored(Box::new(answer)))
        .map_err(edge)
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
    let spec = Operation::TopUp.spec();
    let raw = req.match_info().get("id").unwrap_or_default().to_owned();
    let Intake {
        tenant,
        input: (account, input),
        claim,
        args,
    } = intake(
        &req,
        payload,
        &state,
        spec,
        EmptyBody::Refused,
        async |input: TopUpIn| {
            let account = AccountId::parse(&raw).map_err(ApiError::InvalidRequest)?;
            if input.payment_method.is_empty()
                || input.payment_method.len() > MAX_PAYMENT_METHOD_LEN
                || !input.payment_method.bytes().all(|b| b.is_ascii_graphic())
            {
                return Err(ApiError::InvalidRequest(
                    "`payment_method`: 1 to 255 visible ASCII characters".to_owned(),
                ));
            }
            Ok(((account, input), spec.path_with(&raw)))
        },
    )
    .await?;
    let keyed = claim.is_some();
    let sent_a_key = pipeline::sent_a_key(claim.as_ref());
    let top_ups = match processor_or_stored(&state, tenant.id, &args, false)
        .await
        .map_err(|err| pipeline::without_key(err, sent_a_key))?
    {
        Answerer::Processor(top_ups) => top_ups,
        Answerer::Stored(stored) => return respond(spec, *stored, keyed, render_top_up),
    };
    let answer = top_ups
        .drive(move |top_ups| async move {
            let new = NewTopUp {
                account: &account,
                amount: input.amount,
                currency: top_ups.currency(),
                payment_method: &input.payment_method,
                processor: top_ups.processor(),
            };
            top_ups.create(tenant.id, &args, &new).await
        })
        .await
        .map_err(|e| ApiError::Internal(e.into()))?
        // A second keyless top-up is a second charge: no "retry with the same key" for it.
        .map_err(|err| pipeline::without_key(edge(err), sent_a_key))?;
    respond(spec, answer, keyed, render_top_up)
}

fn render_top_up(row: &TopUpRow) -> Result<Rendered, ApiError> {
    let out = TopUpOut {
        id: TopUpId::from_uuid(row.top_up_id),
        account: row.account_id.0.clone(),
        amount: row.amount.0,
        currency: row.currency.clone(),
        status: "succeeded",
        processor_payment_id: row.processor_payment_id.clone(),
        balance: row
            .balance_after
            .ok_or_else(|| pipeline::corrupt("a succeeded top-up without its balance"))?,
        created_at: row.created_at,
    };
    Ok((
        StatusCode::CREATED,
        json_body(&out)?,
        Some(routes::GET_TOP_UP.with_id(&out.id.to_string())),
    ))
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
    let spec = Operation::RefundTopUp.spec();
    let raw = req.match_info().get("id").unwrap_or_default().to_owned();
    let Intake {
        tenant,
        input: id,
        claim,
        args,
    } = intake(
        &req,
        payload,
        &state,
        spec,
        EmptyBody::MeansEmptyObject,
        async |_: TopUpRefundIn| {
            // An id that is no UUID names no top-up: 404 before anything is claimed.
            let id = TopUpId::parse(&raw).ok_or(ApiError::NotFound)?;
            Ok((id, spec.path_with(&raw)))
        },
    )
    .await?;
    let keyed = claim.is_some();
    let top_ups = match processor_or_stored(&state, tenant.id, &args, true).await? {
        Answerer::Processor(top_ups) => top_ups,
        Answerer::Stored(stored) => return respond(spec, *stored, keyed, render_refund),
    };
    let answer = match top_ups
        .drive(move |top_ups| async move { top_ups.refund(tenant.id, &args, id).await })
        .await
        .map_err(|e| ApiError::Internal(e.into()))?
        .map_err(edge)
    {
        // The refund's SQL answers a top-up still processing as a row in use (nothing
        // claimed): tell that apart from a request with this key in flight.
        Err(ApiError::InProgress) => return Err(in_progress_or_processing(&state, tenant.id, id).await),
        answer => answer?,
    };
    respond(spec, answer, keyed, render_refund)
}

fn render_refund(row: &TopUpRow) -> Result<Rendered, ApiError> {
    let pending = row.refund_debited();
    let out = TopUpRefundOut {
        id: TopUpId::from_uuid(row.top_up_id),
        status: if pending { "refund_pending" } else { "refunded" },
        refunded: row.amount.0,
        balance: row
            .balance_after_refund
            .ok_or_else(|| pipeline::corrupt("a refunded top-up without its balance"))?,
    };
    // A pending refund names where to look and when (found from outside: the 202 said
    // neither); a final one is the top-up's own answer.
    let (status, location) = if pending {
        (
            StatusCode::ACCEPTED,
            Some(routes::GET_TOP_UP.with_id(&out.id.to_string())),
        )
    } else {
        (StatusCode::OK, None)
    };
    Ok((status, json_body(&out)?, location))
}

/// Why a refund found its top-up in use: the top-up is still `processing` (409 naming it, a
/// longer `Retry-After`), a refund of it under another key is under way at the processor
/// (409 saying so: found from outside, a 409 `already_refunded` stored for this key was
/// wrong once that refund failed), or another request with the key drives it (409 in
/// progress).
async fn in_progress_or_processing(state: &AppState, tenant: TenantId, id: TopUpId) -> ApiError {
    let seen = async {
        let mut conn = state.conn().await.ok()?;
        let row = conn
            .run(async |c| ledger::top_ups::top_up(c, tenant, id).await)
            .await
            .ok()??;
        let refunding = row.refund_state.as_ref().is_some_and(|r| r.0 == "debited");
        Some((*row.status == "processing", refunding))
    };
    match seen.await {
        Some((true, _)) => ApiError::TopUpProcessing,
        Some((false, true)) => ApiError::TopUpRefundPending,
        _ => ApiError::InProgress,
    }
}

/// A top-up's current state.
#[utoipa::path(
    get, path = "/top-ups/{id}", tag = "top-ups", operation_id = "get_top_up", security(("api_key" = [])),
    params(("id" = TopUpId, Path, description = "The top-up's id; another tenant's answers 404.")),
    responses(
        (status = 200, description = "The top-up.", body = TopUpStateOut),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized), (status = 404, response = NotFound),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn show(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let tenant = state.tenant(&req).await?;
    no_query(&req)?;
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

/// The tenant's top-ups, newest first (docs/api.md, Lists).
#[utoipa::path(
    get, path = "/top-ups", tag = "top-ups", operation_id = "list_top_ups", security(("api_key" = [])),
    params(TopUpListParams),
    responses(
        (status = 200, description = "A page of top-ups, each as `GET /top-ups/{id}` shows it.", body = ListOut<TopUpStateOut>),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn list(
    req: HttpRequest,
    state: web::Data<AppState>,
    pool: web::Data<WorkerLists>,
) -> Result<HttpResponse, ApiError> {
    let tenant = state.tenant(&req).await?;
    let (page, filters) = lists::query(&req, LIST_FILTERS, TopUpId::parse)?;
    let mut conn = state.list_conn(&pool).await?;
    let page = conn
        .run(async |c| ledger::lists::top_ups(c, tenant.id, filters.status.as_deref(), &page).await)
        .await?
        .ok_or_else(|| lists::unknown_cursor(&page))?;
    Ok(lists::answer(
        routes::LIST_TOP_UPS.path.to_owned(),
        page.map(TopUpStateOut::from),
    ))
}

/// The answer's status, body and `Location`.
type Rendered = (StatusCode, Bytes, Option<String>);

fn respond(
    spec: &Spec,
    answer: Answer,
    keyed: bool,
    render: impl FnOnce(&TopUpRow) -> Result<Rendered, ApiError>,
) -> Result<HttpResponse, ApiError> {
    match answer {
        Answer::Done { row, replayed } => {
            let (status, body, location) = render(&row)?;
            Ok(pipeline::answer(
                status,
                body,
                location.as_deref(),
                Replay::of(keyed, replayed),
            ))
        }
        Answer::RefundPending { row } => {
            // Not final: a retry with the key looks at the refund again. The debit was made:
            // counted as made, not yet as refunded.
            let (status, body, location) = render(&row)?;
            let mut answer = pipeline::answer(status, body, location.as_deref(), Replay::of(keyed, false));
            answer.headers_mut().insert(
                actix_web::http::header::RETRY_AFTER,
                actix_web::http::header::HeaderValue::from(crate::error::TOP_UP_PROCESSING_RETRY_AFTER_SECS),
            );
            Ok(answer)
        }
        Answer::Declined { decline, row, replayed } => Err(ApiError::ProcessorDeclined {
            decline,
            decline_code: row.and_then(|r| r.decline_code),
            replayed,
            detail: spec.decline_detail(decline),
        }),
        Answer::KeyReused => Err(ApiError::KeyReused),
        Answer::KeyExpired => Err(ApiError::KeyExpired),
    }
}

fn edge(err: TopUpError) -> ApiError {
    match err {
        TopUpError::Db(err) => err.into(),
        TopUpError::ProcessorUnknown { top_up, why } => {
            tracing::warn!(
                %top_up,
                why,
                "top-up answered 503: the processor's outcome is unknown, the key stays with it"
            );
            ApiError::ProcessorUnknown { top_up }
        }
        TopUpError::Waiting {
            top_up,
            processor_status,
        } => {
            tracing::info!(
                %top_up,
                processor_status,
                "top-up answered 503: its PaymentIntent waits at the processor, the key stays with it"
            );
            ApiError::ProcessorWaiting { top_up }
        }
        TopUpError::InProgress => ApiError::InProgress,
    }
}
