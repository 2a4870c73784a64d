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
        let reply = self.post(&routes::CREATE_PAYMENT.segments(""), &body, key).await?;
        // Without an account the server's default was charged, whichever it is.
        answers(reply, |p: &Payment| {
            account
                .and_then(|asked| differs("account", p.account.as_str(), asked))
                .or_else(|| differs("amount", &p.charged, &amount))
        })
    }

    /// Refunds the whole payment.
    pub async fn refund(&self, payment: Uuid, key: &IdempotencyKey) -> Result<Reply<Refund>, ClientError> {
        let reply = self
            .post(&routes::REFUND_PAYMENT.segments(&payment.to_string()), &json!({}), key)
            .await?;
        answers(reply, |r: &Refund| differs("payment", &r.id, &payment))
    }

    /// Credits `amount` to `account`.
    pub async fn deposit(
        &self,
        account: &str,
        amount: i64,
        key: &IdempotencyKey,
    ) -> Result<Reply<Deposit>, ClientError> {
        let reply = self
            .post(
                &routes::CREATE_DEPOSIT.segments(account),
                &json!({ "amount": amount }),
                key,
            )
            .await?;
        answers(reply, |d: &Deposit| {
            differs("account", d.account.as_str(), account).or_else(|| differs("amount", &d.amount, &amount))
        })
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
        let reply = self.post(&routes::CREATE_ACCOUNT.segments(""), &body, key).await?;
        answers(reply, |a: &AccountCreated| differs("account", a.id.as_str(), id))
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

/// The answer to an operation, unless it is not this operation's: a success of the right
/// shape whose `mismatch` names a field that differs from what was asked. Such an answer
/// (found from outside: a proxy caching POSTs answered a payment of 999 from account `b1`
/// with another payment's stored 201, and the CLI printed it as done while nothing was) is
/// taken as a success whose body could not be read: its outcome is unknown, and the same
/// key resumes the operation. A replay always matches: the key's fingerprint is the body.
pub(crate) fn answers<T>(
    reply: Reply<T>,
    mismatch: impl FnOnce(&T) -> Option<String>,
) -> Result<Reply<T>, ClientError> {
    match mismatch(&reply.value) {
        None => Ok(reply),
        Some(what) => Err(ClientError::InvalidResponse {
            status: reply.status,
            source: serde::de::Error::custom(format!("the answer is another operation's: {what}")),
        }),
    }
}

/// `Some` naming the field when what was answered is not what was asked.
pub(crate) fn differs<A: PartialEq + std::fmt::Display + ?Sized>(
    field: &str,
    answered: &A,
    asked: &A,
) -> Option<String> {
    (answered != asked).then(|| format!("{field} {answered} where {asked} was asked"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_that_differs_from_what_was_asked_is_not_this_operations() {
        let reply = |account: &str, charged| Reply {
            value: Deposit {
                id: Uuid::nil(),
                account: account.to_owned(),
                amount: charged,
                balance: 0,
            },
            status: 201,
            replayed: true,
            attempts: 1,
        };
        let check =
            |d: &Deposit| differs("account", d.account.as_str(), "u1").or_else(|| differs("amount", &d.amount, &5));
        assert!(answers(reply("u1", 5), check).is_ok());
        for (account, amount, what) in [("u2", 5, "account u2 where u1"), ("u1", 6, "amount 6 where 5")] {
            let err = answers(reply(account, amount), check).unwrap_err();
            assert_eq!(err.code(), "invalid_response");
            assert!(err.outcome_unknown(), "a 2xx: the operation may have been done");
            assert!(err.to_string().contains(what), "{err}");
        }
    }

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
