//! Money movements: each operation is one call of its SQL function (migrations/V2), which
//! claims the idempotency key and applies the effect in one transaction. SQL over
//! `&mut PgConnection`, no HTTP types.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::domain::{AccountId, Amount, OpeningBalance};
use crate::idempotency::Claim;

/// A deterministic failure: stored with the key and replayed like a success.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decline {
    InsufficientFunds,
    AccountNotFound,
    PaymentNotFound,
    AlreadyRefunded,
    AccountExists,
}

impl Decline {
    pub fn code(self) -> &'static str {
        match self {
            Self::InsufficientFunds => "insufficient_funds",
            Self::AccountNotFound => "account_not_found",
            Self::PaymentNotFound => "not_found",
            Self::AlreadyRefunded => "already_refunded",
            Self::AccountExists => "account_exists",
        }
    }

    fn from_code(code: &str) -> Option<Self> {
        [
            Self::InsufficientFunds,
            Self::AccountNotFound,
            Self::PaymentNotFound,
            Self::AlreadyRefunded,
            Self::AccountExists,
        ]
        .into_iter()
        .find(|d| d.code() == code)
    }

    /// The HTTP status this decline is answered with (stored with the key).
    pub fn status(self) -> u16 {
        match self {
            Self::InsufficientFunds => 402,
            Self::AccountNotFound | Self::PaymentNotFound => 404,
            Self::AlreadyRefunded | Self::AccountExists => 409,
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Self::InsufficientFunds => "Insufficient funds",
            Self::AccountNotFound => "Account not found",
            Self::PaymentNotFound => "Not found",
            Self::AlreadyRefunded => "Already refunded",
            Self::AccountExists => "Account exists",
        }
    }

    pub fn detail(self) -> &'static str {
        match self {
            Self::InsufficientFunds => "the account's balance is lower than the amount",
            Self::AccountNotFound => "no such account",
            Self::PaymentNotFound => "no such payment",
            Self::AlreadyRefunded => "the payment was already refunded",
            Self::AccountExists => "an account with this id already exists",
        }
    }
}

/// The answer of an operation that was not refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply<T> {
    /// Processed by this request.
    New(T),
    /// The stored result of an earlier request with the same key.
    Replayed(T),
}

/// Why an operation produced no resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    Declined { decline: Decline, replayed: bool },
    KeyReused,
    KeyExpired,
}

pub type Outcome<T> = Result<Reply<T>, Refusal>;

/// Whether the outcome answers a stored result again (a success or a stored decline).
pub fn is_replay<T>(outcome: &Outcome<T>) -> bool {
    matches!(
        outcome,
        Ok(Reply::Replayed(_)) | Err(Refusal::Declined { replayed: true, .. })
    )
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Payment {
    pub id: Uuid,
    pub account: String,
    pub amount: i64,
    pub balance_after: i64,
    pub created_at: DateTime<Utc>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refund {
    pub payment_id: Uuid,
    pub refunded: i64,
    pub balance_after: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deposit {
    pub id: Uuid,
    pub account: String,
    pub amount: i64,
    pub balance_after: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenedAccount {
    pub id: String,
    pub opening_balance: i64,
    pub created_at: DateTime<Utc>,
}

/// The parts of a claim the SQL functions take; all `None` for a keyless request.
struct KeyArgs<'a> {
    key: Option<&'a str>,
    derived: bool,
    fingerprint: Option<&'a [u8]>,
    window_secs: i32,
}

impl<'a> KeyArgs<'a> {
    fn of(claim: Option<&'a Claim>) -> Self {
        Self {
            key: claim.map(|c| c.key.as_str()),
            derived: claim.is_some_and(|c| c.derived),
            fingerprint: claim.map(|c| &c.fingerprint[..]),
            window_secs: claim.map_or(0, Claim::window_secs),
        }
    }
}

/// Turns a function's `(outcome, error_code)` and resource columns into an [`Outcome`].
fn settle<T>(outcome: &str, error_code: Option<&str>, resource: Option<T>) -> Result<Outcome<T>, sqlx::Error> {
    let decline = |code: Option<&str>| {
        code.and_then(Decline::from_code)
            .ok_or_else(|| corrupt(format!("unknown stored error code {code:?}")))
    };
    let present = |r: Option<T>| r.ok_or_else(|| corrupt("the key's resource is missing".into()));
    Ok(match (outcome, error_code) {
        ("created", _) => Ok(Reply::New(present(resource)?)),
        ("replayed", None) => Ok(Reply::Replayed(present(resource)?)),
        ("replayed", code) => Err(Refusal::Declined {
            decline: decline(code)?,
            replayed: true,
        }),
        ("declined", code) => Err(Refusal::Declined {
            decline: decline(code)?,
            replayed: false,
        }),
        ("key_reused", _) => Err(Refusal::KeyReused),
        ("expired", _) => Err(Refusal::KeyExpired),
        (other, _) => return Err(corrupt(format!("unknown outcome {other:?}"))),
    })
}

fn corrupt(message: String) -> sqlx::Error {
    sqlx::Error::Decode(message.into())
}

pub async fn pay(
    conn: &mut PgConnection,
    tenant: Uuid,
    claim: Option<&Claim>,
    account: &AccountId,
    amount: Amount,
) -> Result<Outcome<Payment>, sqlx::Error> {
    let k = KeyArgs::of(claim);
    let row = sqlx::query!(
        r#"SELECT outcome AS "outcome!", error_code, payment_id, account_id, amount, balance_after, created_at
           FROM oncepay_pay($1, $2, $3, $4, $5, $6, $7)"#,
        tenant,
        k.key,
        k.derived,
        k.fingerprint,
        k.window_secs,
        account.as_str(),
        amount.get(),
    )
    .fetch_one(conn)
    .await?;
    let payment = match (
        row.payment_id,
        row.account_id,
        row.amount,
        row.balance_after,
        row.created_at,
    ) {
        (Some(id), Some(account), Some(amount), Some(balance_after), Some(created_at)) => Some(Payment {
            id,
            account,
            amount,
            balance_after,
            created_at,
        }),
        _ => None,
    };
    settle(&row.outcome, row.error_code.as_deref(), payment)
}

pub async fn refund(
    conn: &mut PgConnection,
    tenant: Uuid,
    claim: Option<&Claim>,
    path: &str,
    payment: Uuid,
) -> Result<Outcome<Refund>, sqlx::Error> {
    let k = KeyArgs::of(claim);
    let row = sqlx::query!(
        r#"SELECT outcome AS "outcome!", error_code, payment_id, refunded, balance_after_refund
           FROM oncepay_refund($1, $2, $3, $4, $5, $6, $7)"#,
        tenant,
        k.key,
        k.derived,
        k.fingerprint,
        path,
        k.window_secs,
        payment,
    )
    .fetch_one(conn)
    .await?;
    let refund = match (row.payment_id, row.refunded, row.balance_after_refund) {
        (Some(payment_id), Some(refunded), Some(balance_after)) => Some(Refund {
            payment_id,
            refunded,
            balance_after,
        }),
        _ => None,
    };
    settle(&row.outcome, row.error_code.as_deref(), refund)
}

pub async fn deposit(
    conn: &mut PgConnection,
    tenant: Uuid,
    claim: Option<&Claim>,
    path: &str,
    account: &AccountId,
    amount: Amount,
) -> Result<Outcome<Deposit>, sqlx::Error> {
    let k = KeyArgs::of(claim);
    let row = sqlx::query!(
        r#"SELECT outcome AS "outcome!", error_code, deposit_id, account_id, amount, balance_after
           FROM oncepay_deposit($1, $2, $3, $4, $5, $6, $7, $8)"#,
        tenant,
        k.key,
        k.derived,
        k.fingerprint,
        path,
        k.window_secs,
        account.as_str(),
        amount.get(),
    )
    .fetch_one(conn)
    .await?;
    let deposit = match (row.deposit_id, row.account_id, row.amount, row.balance_after) {
        (Some(id), Some(account), Some(amount), Some(balance_after)) => Some(Deposit {
            id,
            account,
            amount,
            balance_after,
        }),
        _ => None,
    };
    settle(&row.outcome, row.error_code.as_deref(), deposit)
}

pub async fn open_account(
    conn: &mut PgConnection,
    tenant: Uuid,
    claim: Option<&Claim>,
    account: &AccountId,
    balance: OpeningBalance,
) -> Result<Outcome<OpenedAccount>, sqlx::Error> {
    let k = KeyArgs::of(claim);
    let row = sqlx::query!(
        r#"SELECT outcome AS "outcome!", error_code, account_id, opening_balance, created_at
           FROM oncepay_open_account($1, $2, $3, $4, $5, $6, $7)"#,
        tenant,
        k.key,
        k.derived,
        k.fingerprint,
        k.window_secs,
        account.as_str(),
        balance.get(),
    )
    .fetch_one(conn)
    .await?;
    let opened = match (row.account_id, row.opening_balance, row.created_at) {
        (Some(id), Some(opening_balance), Some(created_at)) => Some(OpenedAccount {
            id,
            opening_balance,
            created_at,
        }),
        _ => None,
    };
    settle(&row.outcome, row.error_code.as_deref(), opened)
}

/// A payment's current state, for `GET /payments/{id}`.
#[derive(Clone, Debug)]
pub struct PaymentState {
    pub id: Uuid,
    pub account: String,
    pub amount: i64,
    pub created_at: DateTime<Utc>,
    pub refunded_at: Option<DateTime<Utc>>,
}

pub async fn payment_state(
    conn: &mut PgConnection,
    tenant: Uuid,
    payment: Uuid,
) -> Result<Option<PaymentState>, sqlx::Error> {
    sqlx::query_as!(
        PaymentState,
        r#"SELECT payment_id AS id, account_id AS account, amount, created_at, refunded_at
           FROM payments WHERE tenant_id = $1 AND payment_id = $2"#,
        tenant,
        payment,
    )
    .fetch_optional(conn)
    .await
}

/// An account's current balance, for `GET /accounts/{id}`.
pub async fn balance(conn: &mut PgConnection, tenant: Uuid, account: &AccountId) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar!(
        "SELECT balance FROM accounts WHERE tenant_id = $1 AND account_id = $2",
        tenant,
        account.as_str(),
    )
    .fetch_optional(conn)
    .await
}
