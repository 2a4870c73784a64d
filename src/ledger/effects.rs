//! One [`Effect`] per operation: its input, its SQL function, the row it answers with.

use std::future::Future;

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{Execute, PgConnection};
use uuid::Uuid;

use super::rows::{AccountRow, DepositRow, PaymentRow, TransferRow};
use super::{settle, ClaimArgs, Outcome};
use crate::db::{Conn, DbError};
use crate::domain::{AccountId, Amount, OpeningBalance, PaymentId, TenantId};
use crate::operation::{ClaimOutcome, Decline, Operation};

/// An operation's effect: one call of its SQL function, which claims the key, applies the
/// effect and answers with the resource's row, in one transaction.
pub trait Effect: Send + Sync {
    const OPERATION: Operation;
    /// The row the answer is rebuilt from.
    type Row: Send;

    fn run(
        &self,
        conn: &mut PgConnection,
        tenant: TenantId,
        claim: &ClaimArgs,
    ) -> impl Future<Output = Result<Outcome<Self::Row>, sqlx::Error>> + Send;
}

/// An effect that can also run as one of many in a single statement (`crate::batch`): one
/// transaction, one commit, for all of them.
pub trait Batched: Effect + Sized + 'static {
    /// The account row its statement locks. The items of a batch run in the order of
    /// (tenant, this) compared as bytes, the order every statement that locks two accounts
    /// takes them in (`oncepay_transfer`, `COLLATE "C"`): so none can wait on another in a
    /// cycle.
    fn lock_order(&self) -> &str;

    /// Runs every item in order in one statement (one transaction) and answers with their
    /// outcomes in the same order. It fails as a whole; whether it committed depends on the
    /// failure (`DbError`: PostgreSQL's error rolled it back, a broken connection or an
    /// unreadable answer leaves the outcome unknown).
    fn run_batch(
        conn: &mut PgConnection,
        items: &[(TenantId, &ClaimArgs, &Self)],
    ) -> impl Future<Output = Result<Vec<Outcome<Self::Row>>, sqlx::Error>> + Send;

    /// The same calls as [`Batched::run_batch`], with the same answers and failures, in one
    /// simple-protocol message ([`Conn::fetch_rendered`]): one round trip where a
    /// transaction-mode pooler makes `run_batch` four. Its statement takes the items as one
    /// JSON argument, since only text can be rendered safely as a literal.
    fn run_batch_rendered(
        conn: &mut Conn,
        items: &[(TenantId, &ClaimArgs, &Self)],
    ) -> impl Future<Output = Result<Vec<Outcome<Self::Row>>, DbError>> + Send;
}

/// One answer of a rendered batch: the columns of the binary path, as `jsonb_build_object`
/// writes them.
#[derive(serde::Deserialize)]
struct RenderedAnswer<R> {
    outcome: ClaimOutcome,
    decline: Option<Decline>,
    expires_at: Option<DateTime<Utc>>,
    resource: Option<R>,
}

/// A batch's answers, `(outcome, decline, expires_at, resource)` in the items' order, as
/// outcomes; any other count than one per item is an answer that cannot be read.
fn settle_batch<R>(
    answers: impl ExactSizeIterator<Item = (ClaimOutcome, Option<Decline>, Option<DateTime<Utc>>, Option<R>)>,
    items: usize,
) -> Result<Vec<Outcome<R>>, sqlx::Error> {
    if answers.len() != items {
        return Err(sqlx::Error::Decode(
            format!("a batch of {items} payments answered {} rows", answers.len()).into(),
        ));
    }
    answers
        .map(|(outcome, decline, expires_at, resource)| settle(outcome, decline, expires_at, resource))
        .collect()
}

/// Charges `amount` to `account`.
#[derive(Clone, Debug)]
pub struct Pay {
    pub account: AccountId,
    pub amount: Amount,
}

impl Effect for Pay {
    const OPERATION: Operation = Operation::Pay;
    type Row = PaymentRow;

    async fn run(
        &self,
        conn: &mut PgConnection,
        tenant: TenantId,
        claim: &ClaimArgs,
    ) -> Result<Outcome<PaymentRow>, sqlx::Error> {
        let r = sqlx::query!(
            r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                      resource AS "resource: PaymentRow"
               FROM oncepay_pay($1, $2, $3, $4)"#,
            tenant.get(),
            claim as _,
            self.account.as_str(),
            self.amount.get(),
        )
        .fetch_one(conn)
        .await?;
        settle(r.outcome, r.decline, r.expires_at, r.resource)
    }
}

impl Batched for Pay {
    fn lock_order(&self) -> &str {
        self.account.as_str()
    }

    /// `oncepay_pay_batch` (migrations/V20): the same function as [`Pay::run`] without its
    /// event, once per item, so its claim and debit rules stay in one place; then, in the same
    /// statement, one INSERT of the `payment.succeeded` events of the payments it created, for
    /// a tenant with a subscribed endpoint. Within the statement each call sees what the
    /// earlier ones wrote, so a key that appears twice is created by the first and replayed by
    /// the second.
    async fn run_batch(
        conn: &mut PgConnection,
        items: &[(TenantId, &ClaimArgs, &Self)],
    ) -> Result<Vec<Outcome<PaymentRow>>, sqlx::Error> {
        let tenants: Vec<_> = items.iter().map(|(tenant, _, _)| tenant.get()).collect();
        let claims: Vec<&ClaimArgs> = items.iter().map(|(_, claim, _)| *claim).collect();
        let accounts: Vec<&str> = items.iter().map(|(_, _, pay)| pay.account.as_str()).collect();
        let amounts: Vec<i64> = items.iter().map(|(_, _, pay)| pay.amount.get()).collect();
        let rows = sqlx::query!(
            r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                      resource AS "resource: PaymentRow"
                 FROM oncepay_pay_batch($1::uuid[], $2::oncepay_claim_args[], $3::text[], $4::bigint[])
                ORDER BY item"#,
            &tenants,
            &claims as _,
            &accounts as _,
            &amounts,
        )
        .fetch_all(conn)
        .await?;
        settle_batch(
            rows.into_iter()
                .map(|r| (r.outcome, r.decline, r.expires_at, r.resource)),
            items.len(),
        )
    }

    /// [`Pay::run_batch`]'s function, reading the items from one JSON array
    /// and answering with one JSON array: `oncepay_pay_many` (migrations/V13), a function so
    /// that its query is planned once per server connection, not once per message. The
    /// statement is checked at compile time like the others; only its `sql()` is sent, with
    /// the argument rendered in (see [`Conn::fetch_rendered`]).
    async fn run_batch_rendered(
        conn: &mut Conn,
        items: &[(TenantId, &ClaimArgs, &Self)],
    ) -> Result<Vec<Outcome<PaymentRow>>, DbError> {
        /// One item as `oncepay_pay_many` reads it (`->>` and `jsonb_populate_record`).
        #[derive(serde::Serialize)]
        struct Item<'a> {
            tenant: Uuid,
            claim: &'a ClaimArgs,
            account: &'a str,
            amount: i64,
        }
        let items_json: Vec<Item<'_>> = items
            .iter()
            .map(|(tenant, claim, pay)| Item {
                tenant: tenant.get(),
                claim,
                account: pay.account.as_str(),
                amount: pay.amount.get(),
            })
            .collect();
        let argument = serde_json::to_string(&items_json).map_err(|err| sqlx::Error::Encode(err.into()))?;
        let statement = sqlx::query_scalar!(
            r#"SELECT oncepay_pay_many($1::text::jsonb) AS "answers!: Json<Vec<RenderedAnswer<PaymentRow>>>""#,
            argument.as_str(),
        );
        let Json(answers) = conn
            .fetch_rendered::<Json<Vec<RenderedAnswer<PaymentRow>>>>(statement.sql(), &argument)
            .await?;
        let answers = answers
            .into_iter()
            .map(|a| (a.outcome, a.decline, a.expires_at, a.resource));
        Ok(settle_batch(answers, items.len())?)
    }
}

/// Refunds a whole payment.
#[derive(Clone, Debug)]
pub struct Refund {
    pub payment: PaymentId,
}

impl Effect for Refund {
    const OPERATION: Operation = Operation::Refund;
    type Row = PaymentRow;

    async fn run(
        &self,
        conn: &mut PgConnection,
        tenant: TenantId,
        claim: &ClaimArgs,
    ) -> Result<Outcome<PaymentRow>, sqlx::Error> {
        let r = sqlx::query!(
            r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                      resource AS "resource: PaymentRow"
               FROM oncepay_refund($1, $2, $3)"#,
            tenant.get(),
            claim as _,
            self.payment.get(),
        )
        .fetch_one(conn)
        .await?;
        settle(r.outcome, r.decline, r.expires_at, r.resource)
    }
}

/// Credits `amount` to `account`.
#[derive(Clone, Debug)]
pub struct Deposit {
    pub account: AccountId,
    pub amount: Amount,
}

impl Effect for Deposit {
    const OPERATION: Operation = Operation::Deposit;
    type Row = DepositRow;

    async fn run(
        &self,
        conn: &mut PgConnection,
        tenant: TenantId,
        claim: &ClaimArgs,
    ) -> Result<Outcome<DepositRow>, sqlx::Error> {
        let r = sqlx::query!(
            r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                      resource AS "resource: DepositRow"
               FROM oncepay_deposit($1, $2, $3, $4)"#,
            tenant.get(),
            claim as _,
            self.account.as_str(),
            self.amount.get(),
        )
        .fetch_one(conn)
        .await?;
        settle(r.outcome, r.decline, r.expires_at, r.resource)
    }
}

/// Opens `account` with an opening balance.
#[derive(Clone, Debug)]
pub struct OpenAccount {
    pub account: AccountId,
    pub balance: OpeningBalance,
}

impl Effect for OpenAccount {
    const OPERATION: Operation = Operation::OpenAccount;
    type Row = AccountRow;

    async fn run(
        &self,
        conn: &mut PgConnection,
        tenant: TenantId,
        claim: &ClaimArgs,
    ) -> Result<Outcome<AccountRow>, sqlx::Error> {
        let r = sqlx::query!(
            r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                      resource AS "resource: AccountRow"
               FROM oncepay_open_account($1, $2, $3, $4)"#,
            tenant.get(),
            claim as _,
            self.account.as_str(),
            self.balance.get(),
        )
        .fetch_one(conn)
        .await?;
        settle(r.outcome, r.decline, r.expires_at, r.resource)
    }
}

/// Moves `amount` from one account of the tenant to another; built only with two different
/// accounts.
#[derive(Clone, Debug)]
pub struct Transfer {
    from: AccountId,
    to: AccountId,
    amount: Amount,
}

/// A transfer from an account to itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SameAccount;

impl Transfer {
    pub fn new(from: AccountId, to: AccountId, amount: Amount) -> Result<Self, SameAccount> {
        if from == to {
            return Err(SameAccount);
        }
        Ok(Self { from, to, amount })
    }
}

impl Effect for Transfer {
    const OPERATION: Operation = Operation::Transfer;
    type Row = TransferRow;

    async fn run(
        &self,
        conn: &mut PgConnection,
        tenant: TenantId,
        claim: &ClaimArgs,
    ) -> Result<Outcome<TransferRow>, sqlx::Error> {
        let r = sqlx::query!(
            r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                      resource AS "resource: TransferRow"
               FROM oncepay_transfer($1, $2, $3, $4, $5)"#,
            tenant.get(),
            claim as _,
            self.from.as_str(),
            self.to.as_str(),
            self.amount.get(),
        )
        .fetch_one(conn)
        .await?;
        settle(r.outcome, r.decline, r.expires_at, r.resource)
    }
}
