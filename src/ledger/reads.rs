//! The current state of resources, for the `GET` endpoints. Rows are read whole, as the
//! operations' functions return them, so both decode through the same row types.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::rows::{AccountRow, PaymentRow, TransferRow};
use crate::domain::{AccountId, PaymentId, TenantId, TransferId};
use crate::operation::{Decline, Operation};

/// A payment's row, for `GET /payments/{id}`.
pub async fn payment_state(
    conn: &mut PgConnection,
    tenant: TenantId,
    payment: PaymentId,
) -> Result<Option<PaymentRow>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: PaymentRow" FROM payments r WHERE tenant_id = $1 AND payment_id = $2"#,
        tenant.get(),
        payment.get(),
    )
    .fetch_optional(conn)
    .await
}

/// A transfer's row, for `GET /transfers/{id}`.
pub async fn transfer(
    conn: &mut PgConnection,
    tenant: TenantId,
    transfer: TransferId,
) -> Result<Option<TransferRow>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TransferRow" FROM transfers r WHERE tenant_id = $1 AND transfer_id = $2"#,
        tenant.get(),
        transfer.get(),
    )
    .fetch_optional(conn)
    .await
}

/// An account's row, for `GET /accounts/{id}`.
pub async fn account(
    conn: &mut PgConnection,
    tenant: TenantId,
    account: &AccountId,
) -> Result<Option<AccountRow>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: AccountRow" FROM accounts r WHERE tenant_id = $1 AND account_id = $2"#,
        tenant.get(),
        account.as_str(),
    )
    .fetch_optional(conn)
    .await
}

/// An idempotency key's row, as `GET /idempotency-keys/{key}` shows it.
#[derive(Clone, Debug)]
pub struct KeyRow {
    pub key: String,
    pub operation: Operation,
    /// The status its requests are answered with (the success's, or a stored decline's).
    pub status: i16,
    /// Whether that status is final: `false` for a top-up (or its refund) whose outcome at
    /// the card processor is not known yet, whose retry may still end as a decline.
    pub settled: bool,
    pub resource_id: Option<String>,
    pub decline: Option<Decline>,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

/// What holds a key that has no committed row ([`key_in_flight`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyHeld {
    /// A request with the key is running: its row is not committed yet.
    InFlight,
    /// A row was committed meanwhile: read it again.
    Present,
    /// No request holds it.
    Absent,
}

/// How long [`key_in_flight`] waits for a transaction holding the key.
const IN_FLIGHT_WAIT_MS: i32 = 20;

/// Whether a request with the tenant's `key` is running, asked of the unique index as a
/// duplicate request does (migrations/V40): a key row is inserted, and so visible, only when
/// its request commits.
pub async fn key_in_flight(conn: &mut PgConnection, tenant: TenantId, key: &str) -> Result<KeyHeld, sqlx::Error> {
    let held = sqlx::query_scalar!(
        r#"SELECT oncepay_key_in_flight($1, $2, $3) AS "held!""#,
        tenant.get(),
        key,
        IN_FLIGHT_WAIT_MS,
    )
    .fetch_one(conn)
    .await?;
    Ok(match held.as_str() {
        "in_flight" => KeyHeld::InFlight,
        "present" => KeyHeld::Present,
        _ => KeyHeld::Absent,
    })
}

/// The tenant's key row `key`, if the tenant has one by that name (another tenant's is none).
pub async fn key(conn: &mut PgConnection, tenant: TenantId, key: &str) -> Result<Option<KeyRow>, sqlx::Error> {
    let row = sqlx::query!(
        r#"SELECT k.key::text AS "key!", k.operation AS "operation!: Operation", k.status::smallint AS "status!",
                  k.resource_id, k.error_code AS "decline: Decline", k.created_at, k.expires_at,
                  NOT EXISTS (SELECT FROM top_ups t
                               WHERE k.operation IN ('top_up', 'refund_top_up') AND k.error_code IS NULL
                                 AND t.tenant_id = k.tenant_id
                                 AND t.top_up_id = CASE WHEN k.operation IN ('top_up', 'refund_top_up')
                                                        THEN k.resource_id::uuid END
                                 AND CASE WHEN k.operation = 'top_up' THEN t.status = 'processing'
                                          ELSE t.refund_state = 'debited' END) AS "settled!"
             FROM idempotency_keys k
            WHERE k.tenant_id = $1 AND k.key = $2"#,
        tenant.get(),
        key,
    )
    .fetch_optional(conn)
    .await?;
    Ok(row.map(|r| KeyRow {
        key: r.key,
        operation: r.operation,
        status: r.status,
        settled: r.settled,
        resource_id: r.resource_id,
        decline: r.decline,
        created_at: r.created_at,
        expires_at: r.expires_at,
    }))
}
