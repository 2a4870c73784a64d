//! The resources' rows as the SQL functions return them (whole-row composites, fields in
//! table order: a test reads each through its function, so a changed or reordered column
//! fails loudly). A column added at the end is left unread: sqlx decodes a composite field
//! by field from the start, which is what lets a schema change add one while replicas of
//! the previous version serve (tests/api/schema_change.rs).

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// A column declared with one of the SQL domains of migrations/V5 (the single-column rules:
/// amounts, balances, account ids). sqlx checks a composite's fields by type name, so each
/// domain decodes through a newtype named after it; the value is its base type's.
macro_rules! sql_domain {
    ($(#[$doc:meta])* $name:ident($inner:ty) = $sql:literal) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, sqlx::Type, serde::Deserialize)]
        #[sqlx(type_name = $sql)]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl std::ops::Deref for $name {
            type Target = $inner;
            fn deref(&self) -> &$inner {
                &self.0
            }
        }

        impl PartialEq<$inner> for $name {
            fn eq(&self, other: &$inner) -> bool {
                self.0 == *other
            }
        }
    };
}

sql_domain!(
    /// `oncepay_amount`: 1 to 10^12 minor units.
    SqlAmount(i64) = "oncepay_amount"
);
sql_domain!(
    /// `oncepay_balance`: never below zero.
    SqlBalance(i64) = "oncepay_balance"
);
sql_domain!(
    /// `oncepay_opening_balance`: 0 to 10^12.
    SqlOpeningBalance(i64) = "oncepay_opening_balance"
);
sql_domain!(
    /// `oncepay_account_id`: the account-id syntax of docs/api.md, Conventions.
    SqlAccountId(String) = "oncepay_account_id"
);

/// In JSON too (`to_jsonb` of the row: a rendered statement's answer, `ledger`), where a
/// column added at the end is ignored as well.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::Type, serde::Deserialize)]
#[sqlx(type_name = "payments")]
pub struct PaymentRow {
    pub tenant_id: Uuid,
    pub payment_id: Uuid,
    pub account_id: String,
    pub amount: SqlAmount,
    pub balance_after: SqlBalance,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
    pub refunded_at: Option<DateTime<Utc>>,
    pub balance_after_refund: Option<i64>,
}

/// A payment as `GET /payments/{id}` and `GET /payments` show it: the columns the answer
/// reads. A list reads these and no more: a page of 100 costs PostgreSQL and the server less
/// for each column left out (docs/bench/README.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaymentState {
    pub payment_id: Uuid,
    pub account_id: String,
    pub amount: SqlAmount,
    pub created_at: DateTime<Utc>,
    pub refunded_at: Option<DateTime<Utc>>,
}

impl From<PaymentRow> for PaymentState {
    fn from(row: PaymentRow) -> Self {
        Self {
            payment_id: row.payment_id,
            account_id: row.account_id,
            amount: row.amount,
            created_at: row.created_at,
            refunded_at: row.refunded_at,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "deposits")]
pub struct DepositRow {
    pub tenant_id: Uuid,
    pub deposit_id: Uuid,
    pub account_id: String,
    pub amount: SqlAmount,
    pub balance_after: i64,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
}

#[derive(Clone, Debug, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "accounts")]
pub struct AccountRow {
    pub tenant_id: Uuid,
    pub account_id: SqlAccountId,
    pub balance: SqlBalance,
    pub opening_balance: SqlOpeningBalance,
    pub created_at: DateTime<Utc>,
}

#[derive(Clone, Debug, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "transfers")]
pub struct TransferRow {
    pub tenant_id: Uuid,
    pub transfer_id: Uuid,
    pub from_account_id: String,
    pub to_account_id: String,
    pub amount: SqlAmount,
    pub from_balance_after: SqlBalance,
    pub to_balance_after: SqlBalance,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// A transfer as `GET /transfers/{id}` and `GET /transfers` show it: the columns the answer
/// reads, and a list reads no more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferState {
    pub transfer_id: Uuid,
    pub from_account_id: String,
    pub to_account_id: String,
    pub amount: SqlAmount,
    pub created_at: DateTime<Utc>,
}

impl From<TransferRow> for TransferState {
    fn from(row: TransferRow) -> Self {
        Self {
            transfer_id: row.transfer_id,
            from_account_id: row.from_account_id,
            to_account_id: row.to_account_id,
            amount: row.amount,
            created_at: row.created_at,
        }
    }
}

sql_domain!(
    /// `oncepay_top_up_status`: `processing`, `succeeded`, `failed`, `refunded`.
    SqlTopUpStatus(String) = "oncepay_top_up_status"
);
sql_domain!(
    /// `oncepay_top_up_recovery_point`: how far an unfinished top-up got (`started`,
    /// `intent_created`, `finished`).
    SqlRecoveryPoint(String) = "oncepay_top_up_recovery_point"
);
sql_domain!(
    /// `oncepay_top_up_refund_state`: `debited` (the processor not yet told) or `refunded`.
    SqlRefundState(String) = "oncepay_top_up_refund_state"
);

/// A card top-up and how far it got (migrations/V8).
#[derive(Clone, Debug, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "top_ups")]
pub struct TopUpRow {
    pub tenant_id: Uuid,
    pub top_up_id: Uuid,
    pub account_id: SqlAccountId,
    pub amount: SqlAmount,
    pub currency: String,
    pub payment_method: String,
    pub status: SqlTopUpStatus,
    pub recovery_point: SqlRecoveryPoint,
    pub processor_payment_id: Option<String>,
    pub failure_code: Option<String>,
    pub decline_code: Option<String>,
    pub balance_after: Option<i64>,
    pub idempotency_key: Option<String>,
    pub refund_state: Option<SqlRefundState>,
    pub refund_key: Option<String>,
    pub processor_refund_id: Option<String>,
    pub balance_after_refund: Option<i64>,
    pub lease_owner: Option<Uuid>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub refunded_at: Option<DateTime<Utc>>,
    /// Its `ONCEPAY_PROCESSOR_NAME` (before migrations/V23: the processor's URL).
    pub processor: String,
    /// The PaymentIntent's status when last seen (migrations/V23 and on).
    pub processor_status: Option<String>,
    /// When the completer looks next at a top-up or refund that waits for the processor.
    pub next_check_at: Option<DateTime<Utc>>,
    /// Looks at a waiting status so far.
    pub checks: i32,
    /// The numbered series of each call's `Idempotency-Key` (`crate::top_ups::processor::KeyedCall`).
    pub create_key_series: i32,
    pub confirm_key_series: i32,
    pub cancel_key_series: i32,
    pub refund_key_series: i32,
    /// The processor's refund status when last seen.
    pub refund_status: Option<String>,
    /// Why the last refund failed; its amount was credited back.
    pub refund_failure_code: Option<String>,
    pub refund_requested_at: Option<DateTime<Utc>>,
}

impl TopUpRow {
    /// Neither the top-up nor its refund waits for the processor.
    pub fn is_settled(&self) -> bool {
        *self.status != "processing" && !self.refund_debited()
    }

    /// The balance was debited for a refund the processor has not finished.
    pub fn refund_debited(&self) -> bool {
        self.refund_state.as_deref().map(String::as_str) == Some("debited")
    }

    /// The status `GET /top-ups/{id}` shows: `refund_pending` while a refund waits for the
    /// processor (the balance debited), otherwise the stored one.
    pub fn shown_status(&self) -> &str {
        if self.refund_debited() {
            "refund_pending"
        } else {
            self.status.as_str()
        }
    }
}
