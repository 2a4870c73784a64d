//! The phases of a card top-up and of its refund (migrations/V8): each a call of its own SQL
//! function, one transaction, no processor call inside. `crate::topup` drives them and makes
//! the processor calls between them.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use super::rows::TopUpRow;
use super::ClaimArgs;
use crate::domain::{AccountId, Amount, TenantId, TopUpId};
use crate::operation::{ClaimOutcome, Decline};

/// What the first phase of a top-up (or of its refund) found.
#[derive(Clone, Debug)]
pub struct Begun {
    pub outcome: ClaimOutcome,
    pub decline: Option<Decline>,
    pub expires_at: Option<DateTime<Utc>>,
    pub row: Option<TopUpRow>,
    /// The caller now holds the top-up's lease: it drives the unfinished top-up (or refund).
    pub owned: bool,
}

/// A new top-up (or the one its key names).
pub struct NewTopUp<'a> {
    pub account: &'a AccountId,
    pub amount: Amount,
    pub currency: &'a str,
    pub payment_method: &'a str,
    /// The processor it is made with (its base URL).
    pub processor: &'a str,
}

pub async fn begin(
    conn: &mut PgConnection,
    tenant: TenantId,
    claim: &ClaimArgs,
    top_up: &NewTopUp<'_>,
    owner: Uuid,
    lease_secs: i32,
) -> Result<Begun, sqlx::Error> {
    let r = sqlx::query!(
        r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                  resource AS "resource: TopUpRow", owned AS "owned!"
           FROM oncepay_top_up_begin($1, $2, $3, $4, $5, $6, $7, $8, $9)"#,
        tenant.get(),
        claim as _,
        top_up.account.as_str(),
        top_up.amount.get(),
        top_up.currency,
        top_up.payment_method,
        owner,
        lease_secs,
        top_up.processor,
    )
    .fetch_one(conn)
    .await?;
    Ok(Begun {
        outcome: r.outcome,
        decline: r.decline,
        expires_at: r.expires_at,
        row: r.resource,
        owned: r.owned,
    })
}

pub async fn refund_begin(
    conn: &mut PgConnection,
    tenant: TenantId,
    claim: &ClaimArgs,
    top_up: TopUpId,
    owner: Uuid,
    lease_secs: i32,
) -> Result<Begun, sqlx::Error> {
    let r = sqlx::query!(
        r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                  resource AS "resource: TopUpRow", owned AS "owned!"
           FROM oncepay_top_up_refund_begin($1, $2, $3, $4, $5)"#,
        tenant.get(),
        claim as _,
        top_up.get(),
        owner,
        lease_secs,
    )
    .fetch_one(conn)
    .await?;
    Ok(Begun {
        outcome: r.outcome,
        decline: r.decline,
        expires_at: r.expires_at,
        row: r.resource,
        owned: r.owned,
    })
}

/// Commits the PaymentIntent's id (if the owner still holds the lease and none was
/// committed); the row as it is now.
pub async fn intent_created(
    conn: &mut PgConnection,
    row: &TopUpRow,
    owner: Uuid,
    intent: &str,
) -> Result<TopUpRow, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_intent_created($1, $2, $3, $4) r"#,
        row.tenant_id,
        row.top_up_id,
        owner,
        intent,
    )
    .fetch_one(conn)
    .await
}

/// The PaymentIntent succeeded: credit the account (once).
pub async fn succeed(conn: &mut PgConnection, row: &TopUpRow, intent: &str) -> Result<TopUpRow, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_succeed($1, $2, $3) r"#,
        row.tenant_id,
        row.top_up_id,
        intent,
    )
    .fetch_one(conn)
    .await
}

/// The processor declined or refused the payment method: the top-up failed, its key stores
/// the decline.
pub async fn fail(
    conn: &mut PgConnection,
    row: &TopUpRow,
    decline: Decline,
    decline_code: Option<&str>,
) -> Result<TopUpRow, sqlx::Error> {
    let status = i16::try_from(decline.status()).unwrap_or(i16::MAX);
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_fail($1, $2, $3, $4, $5) r"#,
        row.tenant_id,
        row.top_up_id,
        decline.code().as_str(),
        decline_code,
        status,
    )
    .fetch_one(conn)
    .await
}

/// The processor refunded: the refund is recorded (once).
pub async fn refunded(conn: &mut PgConnection, row: &TopUpRow, refund: &str) -> Result<TopUpRow, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_refunded($1, $2, $3) r"#,
        row.tenant_id,
        row.top_up_id,
        refund,
    )
    .fetch_one(conn)
    .await
}

/// The owner gives the lease back (a call's outcome is unknown): a retry resumes at once.
pub async fn release(conn: &mut PgConnection, row: &TopUpRow, owner: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "SELECT oncepay_top_up_release($1, $2, $3)",
        row.tenant_id,
        row.top_up_id,
        owner
    )
    .fetch_one(conn)
    .await
    .map(|_| ())
}

/// Up to `limit` unfinished top-ups (or refunds) of `processor` untouched for `after_secs`
/// whose lease is free, leased to `owner` (the completer).
pub async fn claim_stale(
    conn: &mut PgConnection,
    owner: Uuid,
    after_secs: i32,
    lease_secs: i32,
    limit: i32,
    processor: &str,
) -> Result<Vec<TopUpRow>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_claim_stale($1, $2, $3, $4, $5) r"#,
        owner,
        after_secs,
        lease_secs,
        limit,
        processor,
    )
    .fetch_all(conn)
    .await
}

/// Top-ups and refunds waiting for the processor, on every tenant.
pub async fn unfinished(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM top_ups WHERE status = 'processing' OR refund_state = 'debited'"#
    )
    .fetch_one(conn)
    .await
}

/// A top-up's row, for `GET /top-ups/{id}`.
pub async fn top_up(
    conn: &mut PgConnection,
    tenant: TenantId,
    top_up: TopUpId,
) -> Result<Option<TopUpRow>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM top_ups r WHERE tenant_id = $1 AND top_up_id = $2"#,
        tenant.get(),
        top_up.get(),
    )
    .fetch_optional(conn)
    .await
}
