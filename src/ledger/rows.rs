//! The resources' rows as the SQL functions return them (whole-row composites, fields in
//! table order: a test reads each through its function, so a column change fails loudly).

use chrono::{DateTime, Utc};
use uuid::Uuid;

#[derive(Clone, Debug, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "payments")]
pub struct PaymentRow {
    pub tenant_id: Uuid,
    pub payment_id: Uuid,
    pub account_id: String,
    pub amount: i64,
    pub balance_after: i64,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
    pub refunded_at: Option<DateTime<Utc>>,
    pub balance_after_refund: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "deposits")]
pub struct DepositRow {
    pub tenant_id: Uuid,
    pub deposit_id: Uuid,
    pub account_id: String,
    pub amount: i64,
    pub balance_after: i64,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
}

#[derive(Clone, Debug, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "accounts")]
pub struct AccountRow {
    pub tenant_id: Uuid,
    pub account_id: String,
    pub balance: i64,
    pub opening_balance: i64,
    pub created_at: DateTime<Utc>,
}

#[derive(Clone, Debug, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "transfers")]
pub struct TransferRow {
    pub tenant_id: Uuid,
    pub transfer_id: Uuid,
    pub from_account_id: String,
    pub to_account_id: String,
    pub amount: i64,
    pub from_balance_after: i64,
    pub to_balance_after: i64,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
}
