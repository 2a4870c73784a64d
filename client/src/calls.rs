//! One typed method per tenant endpoint of docs/api.md, Endpoints.

use chrono::{DateTime, Utc};
use reqwest::{Method, Url};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::error::ClientError;
use crate::key::IdempotencyKey;
use crate::protocol::routes;
use crate::retry::Call;
use crate::{Client, Reply};

/// `POST /payments`: 201.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payment {
    pub id: Uuid,
    pub account: String,
    pub charged: i64,
    /// The account's balance right after this payment (as of the first answer on a replay).
    pub balance: i64,
    pub status: String,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub created_at: DateTime<Utc>,
}

/// `GET /payments/{id}`: the payment's current state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentState {
    pub id: Uuid,
    pub account: String,
    pub amount: i64,
    /// `succeeded` or `refunded`.
    pub status: String,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "crate::time::rfc3339_opt")]
    pub refunded_at: Option<DateTime<Utc>>,
}

/// `POST /payments/{id}/refund`: 200.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refund {
    pub id: Uuid,
    pub status: String,
    pub refunded: i64,
    pub balance: i64,
}

/// `POST /accounts`: 201.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccountCreated {
    pub id: String,
    pub balance: i64,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub created_at: DateTime<Utc>,
}

/// `GET /accounts/{id}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Account {
    pub id: String,
    pub balance: i64,
    /// When the account was opened (the time `GET /accounts` orders accounts by); `None` from
    /// a server older than this field.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "crate::time::rfc3339_opt"
    )]
    pub created_at: Option<DateTime<Utc>>,
}

/// `POST /accounts/{id}/deposits`: 201.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deposit {
    pub id: Uuid,
    pub account: String,
    pub amount: i64,
    pub balance: i64,
}

impl Client {
    /// Charges `amount` (minor units) to `account` (`main` when `None`).
    pub async fn pay(
        &self,
        amount: i64,
        account: Option<&str>,
        key: &IdempotencyKey,
    ) -> Result<Reply<Payment>, ClientError> {
        let mut body = json!({ "amount": amount });
        if let Some(account) = account {
            body["account"] = json!(account);
        }
        self.post(&routes::CREATE_PAYMENT.segments(""), &body, key).await
    }

    /// Refunds the whole payment.
    pub async fn refund(&self, payment: Uuid, key: &IdempotencyKey) -> Result<Reply<Refund>, ClientError> {
        let payment = payment.to_string();
        self.post(&routes::REFUND_PAYMENT.segments(&payment), &json!({}), key)
            .await
    }

    /// Credits `amount` to `account`.
    pub async fn deposit(
        &self,
        account: &str,
        amount: i64,
        key: &IdempotencyKey,
    ) -> Result<Reply<Deposit>, ClientError> {
        self.post(
            &routes::CREATE_DEPOSIT.segments(account),
            &json!({ "amount": amount }),
            key,
        )
        .await
    }

    /// Opens an account with an opening balance (0 when `None`).
    pub async fn open_account(
        &self,
        id: &str,
        balance: Option<i64>,
        key: &IdempotencyKey,
    ) -> Result<Reply<AccountCreated>, ClientError> {
        let mut body = json!({ "id": id });
        if let Some(balance) = balance {
            body["balance"] = json!(balance);
        }
        self.post(&routes::CREATE_ACCOUNT.segments(""), &body, key).await
    }

    /// The account's current balance.
    pub async fn account(&self, id: &str) -> Result<Reply<Account>, ClientError> {
        self.get(&routes::GET_ACCOUNT.segments(id)).await
    }

    /// The payment's current state.
    pub async fn payment(&self, id: Uuid) -> Result<Reply<PaymentState>, ClientError> {
        self.get(&routes::GET_PAYMENT.segments(&id.to_string())).await
    }

    async fn post<T: DeserializeOwned>(
        &self,
        path: &[&str],
        body: &Value,
        key: &IdempotencyKey,
    ) -> Result<Reply<T>, ClientError> {
        self.execute(self.post_call(path, body, key)?).await
    }

    /// A keyed POST, its body serialised once.
    pub(crate) fn post_call<'k>(
        &self,
        path: &[&str],
        body: &Value,
        key: &'k IdempotencyKey,
    ) -> Result<Call<'k>, ClientError> {
        let body = serde_json::to_vec(body).map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        Ok(Call {
            method: Method::POST,
            url: self.endpoint(path)?,
            body: Some(body),
            key: Some(key),
        })
    }

    /// GETs are idempotent by design: retried by the same table, with no key.
    async fn get<T: DeserializeOwned>(&self, path: &[&str]) -> Result<Reply<T>, ClientError> {
        self.execute(self.get_call(path)?).await
    }

    pub(crate) fn get_call(&self, path: &[&str]) -> Result<Call<'static>, ClientError> {
        Ok(Call {
            method: Method::GET,
            url: self.endpoint(path)?,
            body: None,
            key: None,
        })
    }

    /// The base URL with `segments` appended, each percent-encoded: an account id with a
    /// `/` stays one segment, and the server answers it 400 `invalid_request`. A segment `.`
    /// or `..` (a valid account id or key) cannot travel in a URL, which takes it, and its
    /// percent-encoded forms, for a dot segment and drops it (or the one before it): the call
    /// would reach another path, so it is refused here, nothing sent (`InvalidArgument`).
    pub(crate) fn endpoint(&self, segments: &[&str]) -> Result<Url, ClientError> {
        if let Some(dots) = segments.iter().find(|s| matches!(**s, "." | "..")) {
            let written = segments
                .iter()
                .map(|s| {
                    if s == dots {
                        dots.replace('.', "%2E")
                    } else {
                        (*s).to_owned()
                    }
                })
                .collect::<Vec<_>>()
                .join("/");
            return Err(ClientError::InvalidArgument(format!(
                "`{dots}` cannot be sent in a URL's path, which takes it for a dot segment and drops it; \
                 ask for `/{written}` with curl, which sends it as written"
            )));
        }
        let mut url = self.inner.base.clone();
        url.path_segments_mut()
            .expect("the builder accepts only base URLs")
            .pop_if_empty()
            .extend(segments);
        Ok(url)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_account_reads_with_or_without_its_opening_time() {
        let old: Account = serde_json::from_str(r#"{"id":"main","balance":5}"#).unwrap();
        assert_eq!(old.created_at, None);
        assert_eq!(serde_json::to_string(&old).unwrap(), r#"{"id":"main","balance":5}"#);
        let text = r#"{"id":"main","balance":5,"created_at":"2026-12-07T06:39:44.222294Z"}"#;
        let new: Account = serde_json::from_str(text).unwrap();
        assert!(new.created_at.is_some());
        assert_eq!(
            serde_json::to_string(&new).unwrap(),
            text,
            "printed as the server wrote it"
        );
    }
}
