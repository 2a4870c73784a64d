//! Card top-ups (docs/top-ups.md): typed calls for `POST /accounts/{id}/top-ups`,
//! `GET /top-ups/{id}` and `POST /top-ups/{id}/refund`. A 503 (the processor's outcome
//! unknown) is retried with the same key like any other: the server resumes the top-up and
//! never charges twice.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

use crate::calls::{answers, differs};
use crate::error::ClientError;
use crate::key::IdempotencyKey;
use crate::protocol::routes;
use crate::{Client, Reply};

/// `POST /accounts/{id}/top-ups`: 201, the card charged and the account credited.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopUp {
    pub id: Uuid,
    pub account: String,
    pub amount: i64,
    pub currency: String,
    pub status: String,
    /// The processor's PaymentIntent.
    pub processor_payment_id: Option<String>,
    /// The account's balance right after this top-up.
    pub balance: i64,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub created_at: DateTime<Utc>,
}

/// `GET /top-ups/{id}`: the top-up's current state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopUpState {
    pub id: Uuid,
    pub account: String,
    pub amount: i64,
    pub currency: String,
    /// `processing`, `succeeded`, `failed`, `refund_pending` or `refunded`.
    pub status: String,
    pub processor_payment_id: Option<String>,
    /// The PaymentIntent's status when oncepay last looked (`requires_action`, `processing`
    /// while the top-up waits for it).
    #[serde(default)]
    pub processor_status: Option<String>,
    /// Why a failed top-up failed: `card_declined`, `invalid_payment_method`,
    /// `invalid_request`, `authentication_required`, `capture_required` or `canceled`.
    pub failure_code: Option<String>,
    /// The processor's own reason (its `decline_code` or error `code`).
    #[serde(default)]
    pub decline_code: Option<String>,
    /// Why the last refund failed (its amount was credited back).
    #[serde(default)]
    pub refund_failure_code: Option<String>,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub created_at: DateTime<Utc>,
}

/// `POST /top-ups/{id}/refund`: 200 `refunded`, or 202 `refund_pending` while the processor's
/// refund is pending (`GET /top-ups/{id}` shows how it ends).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopUpRefund {
    pub id: Uuid,
    pub status: String,
    pub refunded: i64,
    pub balance: i64,
}

impl Client {
    /// Charges `amount` to the card `payment_method` (`pm_...`) at the processor and credits
    /// `account` (`main` when `None`) with it.
    pub async fn top_up(
        &self,
        amount: i64,
        payment_method: &str,
        account: Option<&str>,
        key: &IdempotencyKey,
    ) -> Result<Reply<TopUp>, ClientError> {
        let account = account.unwrap_or("main");
        let body = json!({ "amount": amount, "payment_method": payment_method });
        let reply = self
            .execute(self.post_call(&routes::CREATE_TOP_UP.segments(account), &body, key)?)
            .await?;
        answers(reply, |t: &TopUp| {
            differs("account", t.account.as_str(), account).or_else(|| differs("amount", &t.amount, &amount))
        })
    }

    /// The top-up's current state.
    pub async fn get_top_up(&self, id: Uuid) -> Result<Reply<TopUpState>, ClientError> {
        self.execute(self.get_call(&routes::GET_TOP_UP.segments(&id.to_string()))?)
            .await
    }

    /// Debits the top-up's amount from its account, then refunds the card.
    pub async fn refund_top_up(&self, id: Uuid, key: &IdempotencyKey) -> Result<Reply<TopUpRefund>, ClientError> {
        let reply = self
            .execute(self.post_call(&routes::REFUND_TOP_UP.segments(&id.to_string()), &json!({}), key)?)
            .await?;
        answers(reply, |r: &TopUpRefund| differs("top-up", &r.id, &id))
    }
}
