//! `POST /accounts`, `GET /accounts/{id}`, `POST /accounts/{id}/deposits`, `GET /accounts`
//! (docs/api.md, Lists).

use actix_web::{web, HttpRequest, HttpResponse};
use chrono::{DateTime, Utc};
use oncepay_protocol::routes;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::intake::{no_query, present};
use super::lists::{self, ListOut};
use super::pipeline::{corrupt, route, Endpoint};
use super::schemas::{BadRequest, NotFound, Overloaded, Unauthorized, Unavailable};
use crate::domain::{time, AccountId, Amount, DepositId, OpeningBalance};
use crate::error::ApiError;
use crate::ledger::{self, AccountRow, DepositRow};
use crate::state::{AppState, WorkerLists};

pub fn configure(cfg: &mut web::ServiceConfig) {
    route::<OpenAccount>(cfg);
    route::<CreateDeposit>(cfg);
    cfg.route(routes::GET_ACCOUNT.path, super::get().to(show));
    cfg.route(routes::LIST_ACCOUNTS.path, super::get().to(list));
}

/// Body of `POST /accounts`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AccountIn {
    pub id: AccountId,
    /// The opening balance; 0 when absent.
    #[schema(nullable = false)]
    #[serde(default, deserialize_with = "present")]
    pub balance: Option<OpeningBalance>,
}

/// Body of `POST /accounts/{id}/deposits`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DepositIn {
    pub amount: Amount,
}

/// A new account, as of its creation.
#[derive(Serialize, ToSchema)]
pub struct AccountCreatedOut {
    id: String,
    balance: i64,
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
}

/// An account's current balance.
#[derive(Serialize, ToSchema)]
pub(super) struct AccountOut {
    id: AccountId,
    balance: i64,
    /// When it was opened: the time `GET /accounts` orders and windows accounts by.
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
}

impl AccountOut {
    fn of(a: AccountRow) -> Result<Self, ApiError> {
        Ok(Self {
            id: AccountId::parse(&a.account_id.0).map_err(|_| corrupt("a stored account id the syntax refuses"))?,
            balance: a.balance.0,
            created_at: a.created_at,
        })
    }
}

impl super::lists::ListItem for AccountOut {}

/// A deposit, as of its creation.
#[derive(Serialize, ToSchema)]
pub struct DepositOut {
    id: DepositId,
    account: String,
    amount: i64,
    /// The account's balance right after this deposit.
    balance: i64,
}

fn path_account(req: &HttpRequest) -> Result<AccountId, ApiError> {
    AccountId::parse(req.match_info().get("id").unwrap_or_default()).map_err(ApiError::InvalidRequest)
}

pub struct OpenAccount;

impl Endpoint for OpenAccount {
    type Effect = ledger::OpenAccount;
    type In = AccountIn;
    type Out = AccountCreatedOut;

    fn effect(_: &HttpRequest, body: AccountIn) -> Result<(ledger::OpenAccount, Option<String>), ApiError> {
        let balance = body.balance.unwrap_or_default();
        Ok((
            ledger::OpenAccount {
                account: body.id,
                balance,
            },
            None,
        ))
    }

    fn render(a: AccountRow) -> Result<AccountCreatedOut, ApiError> {
        Ok(AccountCreatedOut {
            id: a.account_id.0,
            balance: a.opening_balance.0,
            created_at: a.created_at,
        })
    }
}

pub struct CreateDeposit;

impl Endpoint for CreateDeposit {
    type Effect = ledger::Deposit;
    type In = DepositIn;
    type Out = DepositOut;

    fn effect(req: &HttpRequest, body: DepositIn) -> Result<(ledger::Deposit, Option<String>), ApiError> {
        let account = path_account(req)?;
        let id = account.as_str().to_owned();
        Ok((
            ledger::Deposit {
                account,
                amount: body.amount,
            },
            Some(id),
        ))
    }

    fn render(d: DepositRow) -> Result<DepositOut, ApiError> {
        Ok(DepositOut {
            id: DepositId::from_uuid(d.deposit_id),
            account: d.account_id,
            amount: d.amount.0,
            balance: d.balance_after,
        })
    }
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
    let tenant = state.tenant(&req).await?;
    no_query(&req)?;
    let id = path_account(&req)?;
    let mut conn = state.conn().await?;
    let account = conn
        .run(async |c| ledger::account(c, tenant.id, &id).await)
        .await?
        .ok_or(ApiError::AccountNotFound)?;
    Ok(HttpResponse::Ok().json(AccountOut::of(account)?))
}

/// The query parameters of `GET /accounts`.
pub(super) struct AccountListParams;

impl utoipa::IntoParams for AccountListParams {
    fn into_params(
        _: impl Fn() -> Option<utoipa::openapi::path::ParameterIn>,
    ) -> Vec<utoipa::openapi::path::Parameter> {
        lists::parameters(&[])
    }
}

/// The tenant's accounts, newest first (docs/api.md, Lists; `main` is the oldest).
#[utoipa::path(
    get, path = "/accounts", tag = "accounts", operation_id = "list_accounts", security(("api_key" = [])),
    params(AccountListParams),
    responses(
        (status = 200, description = "A page of accounts, each as `GET /accounts/{id}` shows it.", body = ListOut<AccountOut>),
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
    let (page, _) = lists::query(&req, &[], |raw| AccountId::parse(raw).ok())?;
    let mut conn = state.list_conn(&pool).await?;
    let page = conn
        .run(async |c| ledger::lists::accounts(c, tenant.id, &page).await)
        .await?
        .ok_or_else(|| lists::unknown_cursor(&page))?;
    let page = page.try_map(AccountOut::of)?;
    Ok(lists::answer(routes::LIST_ACCOUNTS.path.to_owned(), page))
}
