//! The current state of resources, for the `GET` endpoints. Rows are read whole, as the
//! operations' functions return them, so both decode through the same row types.

use sqlx::PgConnection;

use super::rows::{PaymentRow, TransferRow};
use crate::domain::{AccountId, PaymentId, TenantId, TransferId};

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

/// An account's current balance, for `GET /accounts/{id}`.
pub async fn balance(
    conn: &mut PgConnection,
    tenant: TenantId,
    account: &AccountId,
) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar!(
        "SELECT balance FROM accounts WHERE tenant_id = $1 AND account_id = $2",
        tenant.get(),
        account.as_str(),
    )
    .fetch_optional(conn)
    .await
}
