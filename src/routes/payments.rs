//! `POST /payments` (alias `POST /pay`), `GET /payments/{id}`, `POST /payments/{id}/refund`.

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;
use uuid::Uuid;

use super::intake::{intake, EmptyBody};
use super::respond;
use super::schemas::{
    BadRequest, BodyTooLarge, Conflict, IdempotencyKeyHeader, InsufficientFunds, KeyRefused, NotFound, Overloaded,
    PaymentIn, RefundIn, RequestTimeout, Unauthorized, Unavailable, UnsupportedMediaType,
};
use crate::domain::{object_fields, required, AccountId, Amount};
use crate::error::ApiError;
use crate::ledger;
use crate::startup::AppState;

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/payments", web::post().to(create))
        .route("/pay", web::post().to(create))
        .route("/payments/{id}", web::get().to(show))
        .route("/payments/{id}/refund", web::post().to(refund));
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
enum PaymentStatus {
    Succeeded,
    Refunded,
}

/// A new payment, as of its creation (a replay answers the same values).
#[derive(Serialize, ToSchema)]
struct PaymentOut {
    id: Uuid,
    account: String,
    charged: i64,
    /// The account's balance right after this payment.
    balance: i64,
    status: PaymentStatus,
    created_at: DateTime<Utc>,
}

/// A payment's current state.
#[derive(Serialize, ToSchema)]
struct PaymentStateOut {
    id: Uuid,
    account: String,
    amount: i64,
    status: PaymentStatus,
    created_at: DateTime<Utc>,
    /// Null until the payment is refunded.
    #[schema(required = true)]
    refunded_at: Option<DateTime<Utc>>,
}

/// A refund: always of the whole payment.
#[derive(Serialize, ToSchema)]
struct RefundOut {
    id: Uuid,
    status: PaymentStatus,
    refunded: i64,
    /// The account's balance right after the refund.
    balance: i64,
}

/// Charges an account, at most once per `Idempotency-Key` (`POST /pay` is an alias).
#[utoipa::path(
    post, path = "/payments", tag = "payments", operation_id = "create_payment",
    request_body = PaymentIn, params(IdempotencyKeyHeader), security(("api_key" = [])),
    responses(
        (status = 201, description = "Charged (or the replay of the first answer).", body = PaymentOut, headers(
            ("Location" = String, description = "`/payments/{id}`"),
            ("Idempotency-Replayed" = String, description = "`true` on a replay, `false` on a first answer; absent without a key"),
        )),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 402, response = InsufficientFunds), (status = 404, response = NotFound),
        (status = 409, response = Conflict), (status = 408, response = RequestTimeout), (status = 413, response = BodyTooLarge),
        (status = 415, response = UnsupportedMediaType), (status = 422, response = KeyRefused),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn create(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let intake = intake(&req, payload, &state, "/payments", EmptyBody::Refused).await?;
    let fields = object_fields(&intake.body, &["amount", "account"]).map_err(ApiError::InvalidRequest)?;
    let amount = Amount::parse("amount", required(fields, "amount").map_err(ApiError::InvalidRequest)?)
        .map_err(ApiError::InvalidRequest)?;
    let account = AccountId::parse_field("account", fields.get("account")).map_err(ApiError::InvalidRequest)?;

    let mut conn = state.conn().await?;
    let result = ledger::pay(&mut conn, intake.tenant.id, intake.claim.as_ref(), &account, amount).await;
    let outcome = conn.discard_if_broken(result)?;
    if ledger::is_replay(&outcome) {
        crate::db::await_replicated(&mut conn).await?;
    }
    respond(outcome, intake.claim.is_some(), StatusCode::CREATED, |p, response| {
        response.insert_header((header::LOCATION, format!("/payments/{}", p.id)));
        PaymentOut {
            id: p.id,
            account: p.account,
            charged: p.amount,
            balance: p.balance_after,
            status: PaymentStatus::Succeeded,
            created_at: p.created_at,
        }
    })
}

/// Payment ids are UUIDs; anything else cannot name a payment (404, like an unknown id).
fn payment_id(req: &HttpRequest) -> Result<Uuid, ApiError> {
    req.match_info()
        .get("id")
        .and_then(|id| Uuid::parse_str(id).ok())
        .ok_or(ApiError::NotFound)
}

/// A payment's current state.
#[utoipa::path(
    get, path = "/payments/{id}", tag = "payments", operation_id = "get_payment", security(("api_key" = [])),
    params(("id" = Uuid, Path, description = "The payment's id; another tenant's answers 404.")),
    responses(
        (status = 200, description = "The payment.", body = PaymentStateOut),
        (status = 401, response = Unauthorized), (status = 404, response = NotFound),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn show(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let tenant = crate::auth::tenant(&req, &state.pool, &state.tenants).await?;
    let id = payment_id(&req)?;
    let mut conn = state.conn().await?;
    let result = ledger::payment_state(&mut conn, tenant.id, id).await;
    let payment = conn.discard_if_broken(result)?.ok_or(ApiError::NotFound)?;
    Ok(HttpResponse::Ok().json(PaymentStateOut {
        id: payment.id,
        account: payment.account,
        amount: payment.amount,
        status: if payment.refunded_at.is_some() {
            PaymentStatus::Refunded
        } else {
            PaymentStatus::Succeeded
        },
        created_at: payment.created_at,
        refunded_at: payment.refunded_at,
    }))
}

/// Refunds a whole payment, at most once.
#[utoipa::path(
    post, path = "/payments/{id}/refund", tag = "payments", operation_id = "refund_payment",
    request_body(content = RefundIn, description = "Empty, or `{}`."),
    params(("id" = Uuid, Path, description = "The payment's id."), IdempotencyKeyHeader),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "Refunded (or the replay of the first answer).", body = RefundOut, headers(
            ("Idempotency-Replayed" = String, description = "`true` on a replay, `false` on a first answer; absent without a key"),
        )),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 404, response = NotFound), (status = 409, response = Conflict),
        (status = 408, response = RequestTimeout), (status = 413, response = BodyTooLarge), (status = 415, response = UnsupportedMediaType),
        (status = 422, response = KeyRefused), (status = 429, response = Overloaded),
        (status = 503, response = Unavailable),
    )
)]
pub(super) async fn refund(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let intake = intake(&req, payload, &state, req.path(), EmptyBody::MeansEmptyObject).await?;
    object_fields(&intake.body, &[]).map_err(ApiError::InvalidRequest)?;
    let id = payment_id(&req)?;

    let mut conn = state.conn().await?;
    let result = ledger::refund(&mut conn, intake.tenant.id, intake.claim.as_ref(), req.path(), id).await;
    let outcome = conn.discard_if_broken(result)?;
    if ledger::is_replay(&outcome) {
        crate::db::await_replicated(&mut conn).await?;
    }
    respond(outcome, intake.claim.is_some(), StatusCode::OK, |r, _| RefundOut {
        id: r.payment_id,
        status: PaymentStatus::Refunded,
        refunded: r.refunded,
        balance: r.balance_after,
    })
}
