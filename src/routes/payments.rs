//! `POST /payments` (alias `POST /pay`), `GET /payments/{id}`, `POST /payments/{id}/refund`,
//! `GET /payments` (docs/api.md, Lists).

use actix_web::{web, HttpRequest, HttpResponse};
use chrono::{DateTime, Utc};
use oncepay_protocol::routes;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::intake::{no_query, present, EmptyBody};
use super::lists::{self, Filter, ListItem, ListOut};
use super::pipeline::{corrupt, route, Endpoint};
use super::schemas::{BadRequest, NotFound, Overloaded, Unauthorized, Unavailable};
use crate::db::DbError;
use crate::domain::{time, AccountId, Amount, PaymentId, TenantId};
use crate::error::ApiError;
use crate::ledger::lists::PaymentStatus as StatusFilter;
use crate::ledger::{self, ClaimArgs, Outcome, PaymentRow, PaymentState};
use crate::state::{AppState, WorkerLists};

pub fn configure(cfg: &mut web::ServiceConfig) {
    route::<CreatePayment>(cfg);
    // Before the paths with an id: actix tries each route in turn, and matching one with an
    // id costs a regex run (12k instructions a request for the two ahead of it).
    cfg.route(routes::LIST_PAYMENTS.path, super::get().to(list));
    route::<RefundPayment>(cfg);
    cfg.route(routes::GET_PAYMENT.path, super::get().to(show));
}

/// Body of `POST /payments` and `POST /pay`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PaymentIn {
    pub amount: Amount,
    /// The account to charge; `main` when absent.
    #[schema(nullable = false)]
    #[serde(default, deserialize_with = "present")]
    pub account: Option<AccountId>,
}

/// Body of `POST /payments/{id}/refund`: empty, or an empty object (a refund is always of
/// the whole payment).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RefundIn {}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum PaymentStatus {
    Succeeded,
    Refunded,
}

/// A new payment, as of its creation (a replay answers the same values).
#[derive(Serialize, ToSchema)]
pub struct PaymentOut {
    id: PaymentId,
    account: String,
    charged: i64,
    /// The account's balance right after this payment.
    balance: i64,
    status: PaymentStatus,
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
}

/// A refund: always of the whole payment.
#[derive(Serialize, ToSchema)]
pub struct RefundOut {
    id: PaymentId,
    status: PaymentStatus,
    refunded: i64,
    /// The account's balance right after the refund.
    balance: i64,
}

/// A payment's current state.
#[derive(Serialize, ToSchema)]
pub(super) struct PaymentStateOut {
    id: PaymentId,
    account: String,
    amount: i64,
    status: PaymentStatus,
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
    /// Null until the payment is refunded.
    #[schema(required = true)]
    #[serde(serialize_with = "time::rfc3339_opt")]
    refunded_at: Option<DateTime<Utc>>,
}

pub struct CreatePayment;

impl Endpoint for CreatePayment {
    type Effect = ledger::Pay;
    type In = PaymentIn;
    type Out = PaymentOut;

    fn effect(_: &HttpRequest, body: PaymentIn) -> Result<(ledger::Pay, Option<String>), ApiError> {
        let account = body.account.unwrap_or_else(AccountId::main);
        Ok((
            ledger::Pay {
                account,
                amount: body.amount,
            },
            None,
        ))
    }

    /// Payments arriving together share a statement (`crate::batch`).
    async fn execute(
        state: &AppState,
        tenant: TenantId,
        claim: ClaimArgs,
        pay: ledger::Pay,
    ) -> Result<Outcome<PaymentRow>, DbError> {
        state.pay(tenant, claim, pay).await
    }

    fn render(p: PaymentRow) -> Result<PaymentOut, ApiError> {
        Ok(PaymentOut {
            id: PaymentId::from_uuid(p.payment_id),
            account: p.account_id,
            charged: p.amount.0,
            balance: p.balance_after.0,
            status: PaymentStatus::Succeeded,
            created_at: p.created_at,
        })
    }

    fn location(out: &PaymentOut) -> Option<String> {
        Some(routes::GET_PAYMENT.with_id(&out.id.to_string()))
    }
}

pub struct RefundPayment;

impl Endpoint for RefundPayment {
    type Effect = ledger::Refund;
    type In = RefundIn;
    type Out = RefundOut;
    const EMPTY_BODY: EmptyBody = EmptyBody::MeansEmptyObject;

    fn effect(req: &HttpRequest, _: RefundIn) -> Result<(ledger::Refund, Option<String>), ApiError> {
        let payment = payment_id(req)?;
        Ok((ledger::Refund { payment }, Some(payment.to_string())))
    }

    fn render(p: PaymentRow) -> Result<RefundOut, ApiError> {
        Ok(RefundOut {
            id: PaymentId::from_uuid(p.payment_id),
            status: PaymentStatus::Refunded,
            refunded: p.amount.0,
            balance: p
                .balance_after_refund
                .ok_or_else(|| corrupt("a refunded payment without its balance"))?,
        })
    }
}

/// Payment ids are UUIDs; anything else cannot name a payment (404, like an unknown id).
fn payment_id(req: &HttpRequest) -> Result<PaymentId, ApiError> {
    req.match_info()
        .get("id")
        .and_then(PaymentId::parse)
        .ok_or(ApiError::NotFound)
}

/// A payment's current state.
#[utoipa::path(
    get, path = "/payments/{id}", tag = "payments", operation_id = "get_payment", security(("api_key" = [])),
    params(("id" = PaymentId, Path, description = "The payment's id; another tenant's answers 404.")),
    responses(
        (status = 200, description = "The payment.", body = PaymentStateOut),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized), (status = 404, response = NotFound),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn show(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let tenant = state.tenant(&req).await?;
    no_query(&req)?;
    let id = payment_id(&req)?;
    let mut conn = state.conn().await?;
    let p = conn
        .run(async |c| ledger::payment_state(c, tenant.id, id).await)
        .await?
        .ok_or(ApiError::NotFound)?;
    Ok(HttpResponse::Ok().json(PaymentStateOut::from(PaymentState::from(p))))
}

impl From<PaymentState> for PaymentStateOut {
    fn from(p: PaymentState) -> Self {
        Self {
            id: PaymentId::from_uuid(p.payment_id),
            account: p.account_id,
            amount: p.amount.0,
            status: if p.refunded_at.is_some() {
                PaymentStatus::Refunded
            } else {
                PaymentStatus::Succeeded
            },
            created_at: p.created_at,
            refunded_at: p.refunded_at,
        }
    }
}

/// Written by hand, in the field order of its `Serialize`, to the same bytes
/// (`tests::a_listed_payment_is_written_as_serde_json_writes_it`): through `Serialize`, each
/// key went through the string escaper and each value through serde's calls, a third of the
/// server's instructions for a page of 100 payments (`make callgrind`, the list phase). A
/// field added to `PaymentStateOut` fails that test until it is written here too.
impl ListItem for PaymentStateOut {
    fn write_json(&self, out: &mut Vec<u8>) -> Result<(), sonic_rs::Error> {
        out.extend_from_slice(br#"{"id":""#);
        out.extend_from_slice(
            self.id
                .get()
                .hyphenated()
                .encode_lower(&mut Uuid::encode_buffer())
                .as_bytes(),
        );
        out.extend_from_slice(br#"","account":"#);
        // The one field of a client's characters: escaped.
        sonic_rs::to_writer(&mut *out, &self.account)?;
        out.extend_from_slice(br#","amount":"#);
        out.extend_from_slice(itoa::Buffer::new().format(self.amount).as_bytes());
        out.extend_from_slice(match self.status {
            PaymentStatus::Succeeded => br#","status":"succeeded","created_at":"#.as_slice(),
            PaymentStatus::Refunded => br#","status":"refunded","created_at":"#.as_slice(),
        });
        time::append_json(&self.created_at, out);
        out.extend_from_slice(br#","refunded_at":"#);
        match &self.refunded_at {
            Some(at) => time::append_json(at, out),
            None => out.extend_from_slice(b"null"),
        }
        out.push(b'}');
        Ok(())
    }
}

pub(super) const LIST_FILTERS: &[Filter] = &[Filter::Account, Filter::Status(&["succeeded", "refunded"])];

/// The query parameters of `GET /payments`.
pub(super) struct PaymentListParams;

impl utoipa::IntoParams for PaymentListParams {
    fn into_params(
        _: impl Fn() -> Option<utoipa::openapi::path::ParameterIn>,
    ) -> Vec<utoipa::openapi::path::Parameter> {
        lists::parameters(LIST_FILTERS)
    }
}

/// The tenant's payments, newest first (docs/api.md, Lists).
#[utoipa::path(
    get, path = "/payments", tag = "payments", operation_id = "list_payments", security(("api_key" = [])),
    params(PaymentListParams),
    responses(
        (status = 200, description = "A page of payments, each as `GET /payments/{id}` shows it.", body = ListOut<PaymentStateOut>),
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
    let (page, filters) = lists::query(&req, LIST_FILTERS, PaymentId::parse)?;
    let account = lists::account(&filters)?;
    let status = filters.status.as_deref().and_then(StatusFilter::parse);
    let mut conn = state.list_conn(&pool).await?;
    let page = conn
        .run(async |c| ledger::lists::payments(c, tenant.id, account.as_ref(), status, &page).await)
        .await?
        .ok_or_else(|| lists::unknown_cursor(&page))?;
    Ok(lists::answer(
        routes::LIST_PAYMENTS.path.to_owned(),
        page.map(PaymentStateOut::from),
    ))
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use proptest::prelude::*;

    use super::*;

    fn time() -> impl Strategy<Value = DateTime<Utc>> {
        // Years 1-9999 and beyond (chrono's own form), to the nanosecond.
        (-62_135_596_800i64..300_000_000_000, 0u32..1_000_000_000)
            .prop_map(|(secs, nanos)| Utc.timestamp_opt(secs, nanos).unwrap())
    }

    proptest! {
        #[test]
        fn a_listed_payment_is_written_as_serde_json_writes_it(
            id: u128,
            account in prop_oneof![any::<String>(), "[\\x00-\\x1f\"\\\\/\\u{7f}-\\u{a0}\\u{2028}a-z_]{0,24}"],
            amount: i64,
            created_at in time(),
            refunded_at in prop::option::of(time()),
        ) {
            let payment = PaymentStateOut {
                id: PaymentId::from_uuid(Uuid::from_u128(id)),
                account,
                amount,
                status: if refunded_at.is_some() { PaymentStatus::Refunded } else { PaymentStatus::Succeeded },
                created_at,
                refunded_at,
            };
            let mut ours = Vec::new();
            payment.write_json(&mut ours).unwrap();
            let serde = serde_json::to_vec(&payment).unwrap();
            prop_assert_eq!(String::from_utf8_lossy(&ours), String::from_utf8_lossy(&serde));
        }
    }
}
