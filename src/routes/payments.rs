//! `POST /payments` (alias `POST /pay`), `GET /payments/{id}`, `POST /payments/{id}/refund`.

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::intake::{intake, EmptyBody};
use super::respond;
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

#[derive(Serialize)]
struct PaymentOut {
    id: Uuid,
    account: String,
    charged: i64,
    balance: i64,
    status: &'static str,
    created_at: DateTime<Utc>,
}

#[derive(Serialize)]
struct PaymentStateOut {
    id: Uuid,
    account: String,
    amount: i64,
    status: &'static str,
    created_at: DateTime<Utc>,
    refunded_at: Option<DateTime<Utc>>,
}

#[derive(Serialize)]
struct RefundOut {
    id: Uuid,
    status: &'static str,
    refunded: i64,
    balance: i64,
}

async fn create(req: HttpRequest, payload: web::Payload, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let intake = intake(&req, payload, &state, "/payments", EmptyBody::Refused).await?;
    let fields = object_fields(&intake.body, &["amount", "account"]).map_err(ApiError::InvalidRequest)?;
    let amount = Amount::parse("amount", required(fields, "amount").map_err(ApiError::InvalidRequest)?)
        .map_err(ApiError::InvalidRequest)?;
    let account = AccountId::parse_field("account", fields.get("account")).map_err(ApiError::InvalidRequest)?;

    let mut conn = state.conn().await?;
    let result = ledger::pay(&mut conn, intake.tenant.id, intake.claim.as_ref(), &account, amount).await;
    let outcome = conn.discard_if_broken(result)?;
    respond(outcome, intake.claim.is_some(), StatusCode::CREATED, |p, response| {
        response.insert_header((header::LOCATION, format!("/payments/{}", p.id)));
        PaymentOut {
            id: p.id,
            account: p.account,
            charged: p.amount,
            balance: p.balance_after,
            status: "succeeded",
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

async fn show(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
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
            "refunded"
        } else {
            "succeeded"
        },
        created_at: payment.created_at,
        refunded_at: payment.refunded_at,
    }))
}

async fn refund(req: HttpRequest, payload: web::Payload, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let intake = intake(&req, payload, &state, req.path(), EmptyBody::MeansEmptyObject).await?;
    object_fields(&intake.body, &[]).map_err(ApiError::InvalidRequest)?;
    let id = payment_id(&req)?;

    let mut conn = state.conn().await?;
    let result = ledger::refund(&mut conn, intake.tenant.id, intake.claim.as_ref(), req.path(), id).await;
    let outcome = conn.discard_if_broken(result)?;
    respond(outcome, intake.claim.is_some(), StatusCode::OK, |r, _| RefundOut {
        id: r.payment_id,
        status: "refunded",
        refunded: r.refunded,
        balance: r.balance_after,
    })
}
