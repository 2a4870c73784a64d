//! `POST /accounts`, `GET /accounts/{id}`, `POST /accounts/{id}/deposits`.

use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;
use uuid::Uuid;

use super::intake::{intake, EmptyBody};
use super::respond;
use super::schemas::{
    AccountIn, BadRequest, BodyTooLarge, Conflict, DepositIn, IdempotencyKeyHeader, KeyRefused, NotFound, Overloaded,
    RequestTimeout, Unauthorized, Unavailable, UnsupportedMediaType,
};
use crate::domain::{object_fields, required, AccountId, Amount, OpeningBalance};
use crate::error::ApiError;
use crate::ledger;
use crate::startup::AppState;

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/accounts", web::post().to(create))
        .route("/accounts/{id}", web::get().to(show))
        .route("/accounts/{id}/deposits", web::post().to(deposit));
}

/// A new account, as of its creation.
#[derive(Serialize, ToSchema)]
struct AccountCreatedOut {
    id: String,
    balance: i64,
    created_at: DateTime<Utc>,
}

/// An account's current balance.
#[derive(Serialize, ToSchema)]
struct AccountOut {
    id: String,
    balance: i64,
}

/// A deposit, as of its creation.
#[derive(Serialize, ToSchema)]
struct DepositOut {
    id: Uuid,
    account: String,
    amount: i64,
    /// The account's balance right after this deposit.
    balance: i64,
}

fn path_account(req: &HttpRequest) -> Result<AccountId, ApiError> {
    AccountId::parse(req.match_info().get("id").unwrap_or_default()).map_err(ApiError::InvalidRequest)
}

/// Opens an account, at most once per `Idempotency-Key`.
#[utoipa::path(
    post, path = "/accounts", tag = "accounts", operation_id = "create_account",
    request_body = AccountIn, params(IdempotencyKeyHeader), security(("api_key" = [])),
    responses(
        (status = 201, description = "Opened (or the replay of the first answer).", body = AccountCreatedOut, headers(
            ("Idempotency-Replayed" = String, description = "`true` on a replay, `false` on a first answer; absent without a key"),
        )),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
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
    let intake = intake(&req, payload, &state, "/accounts", EmptyBody::Refused).await?;
    let fields = object_fields(&intake.body, &["id", "balance"]).map_err(ApiError::InvalidRequest)?;
    let id = match required(fields, "id").map_err(ApiError::InvalidRequest)? {
        serde_json::Value::String(id) => AccountId::parse(id).map_err(ApiError::InvalidRequest)?,
        _ => return Err(ApiError::InvalidRequest("`id` must be a string".to_owned())),
    };
    let balance = fields
        .get("balance")
        .map(|b| OpeningBalance::parse("balance", b))
        .transpose()
        .map_err(ApiError::InvalidRequest)?
        .unwrap_or_default();

    let mut conn = state.conn().await?;
    let result = ledger::open_account(&mut conn, intake.tenant.id, intake.claim.as_ref(), &id, balance).await;
    let outcome = conn.discard_if_broken(result)?;
    if ledger::is_replay(&outcome) {
        crate::db::await_replicated(&mut conn).await?;
    }
    respond(outcome, intake.claim.is_some(), StatusCode::CREATED, |a, _| {
        AccountCreatedOut {
            id: a.id,
            balance: a.opening_balance,
            created_at: a.created_at,
        }
    })
}

/// An account's current balance.
#[utoipa::path(
    get, path = "/accounts/{id}", tag = "accounts", operation_id = "get_account", security(("api_key" = [])),
    params(("id" = AccountId, Path, description = "The account's id; another tenant's answers 404.")),
    responses(
        (status = 200, description = "The account.", body = AccountOut),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 404, response = NotFound), (status = 429, response = Overloaded),
        (status = 503, response = Unavailable),
    )
)]
pub(super) async fn show(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let tenant = crate::auth::tenant(&req, &state.pool, &state.tenants).await?;
    let id = path_account(&req)?;
    let mut conn = state.conn().await?;
    let result = ledger::balance(&mut conn, tenant.id, &id).await;
    let balance = conn.discard_if_broken(result)?.ok_or(ApiError::AccountNotFound)?;
    Ok(HttpResponse::Ok().json(AccountOut {
        id: id.as_str().to_owned(),
        balance,
    }))
}

/// Credits an account, at most once per `Idempotency-Key`.
#[utoipa::path(
    post, path = "/accounts/{id}/deposits", tag = "accounts", operation_id = "create_deposit",
    request_body = DepositIn, security(("api_key" = [])),
    params(("id" = AccountId, Path, description = "The account's id."), IdempotencyKeyHeader),
    responses(
        (status = 201, description = "Deposited (or the replay of the first answer).", body = DepositOut, headers(
            ("Idempotency-Replayed" = String, description = "`true` on a replay, `false` on a first answer; absent without a key"),
        )),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 404, response = NotFound), (status = 409, response = Conflict),
        (status = 408, response = RequestTimeout), (status = 413, response = BodyTooLarge), (status = 415, response = UnsupportedMediaType),
        (status = 422, response = KeyRefused), (status = 429, response = Overloaded),
        (status = 503, response = Unavailable),
    )
)]
pub(super) async fn deposit(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let intake = intake(&req, payload, &state, req.path(), EmptyBody::Refused).await?;
    let fields = object_fields(&intake.body, &["amount"]).map_err(ApiError::InvalidRequest)?;
    let amount = Amount::parse("amount", required(fields, "amount").map_err(ApiError::InvalidRequest)?)
        .map_err(ApiError::InvalidRequest)?;
    let account = path_account(&req)?;

    let mut conn = state.conn().await?;
    let result = ledger::deposit(
        &mut conn,
        intake.tenant.id,
        intake.claim.as_ref(),
        req.path(),
        &account,
        amount,
    )
    .await;
    let outcome = conn.discard_if_broken(result)?;
    if ledger::is_replay(&outcome) {
        crate::db::await_replicated(&mut conn).await?;
    }
    respond(outcome, intake.claim.is_some(), StatusCode::CREATED, |d, _| {
        DepositOut {
            id: d.id,
            account: d.account,
            amount: d.amount,
            balance: d.balance_after,
        }
    })
}
