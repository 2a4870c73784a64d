//! `POST /transfers`, `GET /transfers/{id}`, `GET /transfers` (docs/api.md, Lists).

use actix_web::{web, HttpRequest, HttpResponse};
use chrono::{DateTime, Utc};
use oncepay_protocol::routes;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::intake::no_query;
use super::lists::{self, Filter, ListOut};
use super::pipeline::{route, Endpoint};
use super::schemas::{BadRequest, NotFound, Overloaded, Unauthorized, Unavailable};
use crate::domain::{time, AccountId, Amount, TransferId};
use crate::error::ApiError;
use crate::ledger::{self, TransferRow, TransferState};
use crate::state::{AppState, WorkerLists};

pub fn configure(cfg: &mut web::ServiceConfig) {
    route::<CreateTransfer>(cfg);
    cfg.route(routes::GET_TRANSFER.path, super::get().to(show));
    cfg.route(routes::LIST_TRANSFERS.path, super::get().to(list));
}

/// Body of `POST /transfers`: two different accounts of the tenant.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TransferIn {
    pub from: AccountId,
    pub to: AccountId,
    pub amount: Amount,
}

/// A new transfer, as of its creation (a replay answers the same values).
#[derive(Serialize, ToSchema)]
pub struct TransferOut {
    id: TransferId,
    from: String,
    to: String,
    amount: i64,
    /// The balance of `from` right after this transfer.
    from_balance: i64,
    /// The balance of `to` right after this transfer.
    to_balance: i64,
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
}

/// A transfer (transfers never change).
#[derive(Serialize, ToSchema)]
pub(super) struct TransferStateOut {
    id: TransferId,
    from: String,
    to: String,
    amount: i64,
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
}

impl super::lists::ListItem for TransferStateOut {}

pub struct CreateTransfer;

impl Endpoint for CreateTransfer {
    type Effect = ledger::Transfer;
    type In = TransferIn;
    type Out = TransferOut;

    fn effect(_: &HttpRequest, body: TransferIn) -> Result<(ledger::Transfer, Option<String>), ApiError> {
        let transfer = ledger::Transfer::new(body.from, body.to, body.amount)
            .map_err(|_| ApiError::InvalidRequest("`from` and `to` must be different accounts".to_owned()))?;
        Ok((transfer, None))
    }

    fn render(t: TransferRow) -> Result<TransferOut, ApiError> {
        Ok(TransferOut {
            id: TransferId::from_uuid(t.transfer_id),
            from: t.from_account_id,
            to: t.to_account_id,
            amount: t.amount.0,
            from_balance: t.from_balance_after.0,
            to_balance: t.to_balance_after.0,
            created_at: t.created_at,
        })
    }

    fn location(out: &TransferOut) -> Option<String> {
        Some(routes::GET_TRANSFER.with_id(&out.id.to_string()))
    }
}

/// A transfer.
#[utoipa::path(
    get, path = "/transfers/{id}", tag = "transfers", operation_id = "get_transfer", security(("api_key" = [])),
    params(("id" = TransferId, Path, description = "The transfer's id; another tenant's answers 404.")),
    responses(
        (status = 200, description = "The transfer.", body = TransferStateOut),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized), (status = 404, response = NotFound),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn show(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let tenant = state.tenant(&req).await?;
    no_query(&req)?;
    let id = req
        .match_info()
        .get("id")
        .and_then(TransferId::parse)
        .ok_or(ApiError::NotFound)?;
    let mut conn = state.conn().await?;
    let t = conn
        .run(async |c| ledger::transfer(c, tenant.id, id).await)
        .await?
        .ok_or(ApiError::NotFound)?;
    Ok(HttpResponse::Ok().json(TransferStateOut::from(TransferState::from(t))))
}

impl From<TransferState> for TransferStateOut {
    fn from(t: TransferState) -> Self {
        Self {
            id: TransferId::from_uuid(t.transfer_id),
            from: t.from_account_id,
            to: t.to_account_id,
            amount: t.amount.0,
            created_at: t.created_at,
        }
    }
}

pub(super) const LIST_FILTERS: &[Filter] = &[Filter::Account];

/// The query parameters of `GET /transfers`.
pub(super) struct TransferListParams;

impl utoipa::IntoParams for TransferListParams {
    fn into_params(
        _: impl Fn() -> Option<utoipa::openapi::path::ParameterIn>,
    ) -> Vec<utoipa::openapi::path::Parameter> {
        lists::parameters(LIST_FILTERS)
    }
}

/// The tenant's transfers, newest first (docs/api.md, Lists); `account` keeps those with the
/// account on either side.
#[utoipa::path(
    get, path = "/transfers", tag = "transfers", operation_id = "list_transfers", security(("api_key" = [])),
    params(TransferListParams),
    responses(
        (status = 200, description = "A page of transfers, each as `GET /transfers/{id}` shows it.", body = ListOut<TransferStateOut>),
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
    let (page, filters) = lists::query(&req, LIST_FILTERS, TransferId::parse)?;
    let account = lists::account(&filters)?;
    let mut conn = state.list_conn(&pool).await?;
    let page = conn
        .run(async |c| ledger::lists::transfers(c, tenant.id, account.as_ref(), &page).await)
        .await?
        .ok_or_else(|| lists::unknown_cursor(&page))?;
    Ok(lists::answer(
        routes::LIST_TRANSFERS.path.to_owned(),
        page.map(TransferStateOut::from),
    ))
}
