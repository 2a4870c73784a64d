//! Transfers between two accounts of the tenant (docs/api.md, Endpoints): `POST /transfers` and
//! `GET /transfers/{id}`.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

use crate::calls::{answers, differs};
use crate::error::ClientError;
use crate::key::IdempotencyKey;
use crate::protocol::routes;
use crate::retry::Call;
use crate::{Client, Reply};

/// `POST /transfers`: 201.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    pub id: Uuid,
    pub from: String,
    pub to: String,
    pub amount: i64,
    /// The balances right after this transfer (as of the first answer on a replay).
    pub from_balance: i64,
    pub to_balance: i64,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub created_at: DateTime<Utc>,
}

/// `GET /transfers/{id}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferState {
    pub id: Uuid,
    pub from: String,
    pub to: String,
    pub amount: i64,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub created_at: DateTime<Utc>,
}

impl Client {
    /// Moves `amount` (minor units) from the account `from` to the account `to`, atomically.
    /// Declines are final: 402 `insufficient_funds`, 404 `account_not_found`, and 400
    /// `invalid_request` when `from` equals `to`.
    pub async fn transfer(
        &self,
        from: &str,
        to: &str,
        amount: i64,
        key: &IdempotencyKey,
    ) -> Result<Reply<Transfer>, ClientError> {
        let reply = self.execute(self.transfer_call(from, to, amount, key)?).await?;
        answers(reply, |t: &Transfer| {
            differs("from", t.from.as_str(), from)
                .or_else(|| differs("to", t.to.as_str(), to))
                .or_else(|| differs("amount", &t.amount, &amount))
        })
    }

    /// A transfer, as it was made.
    pub async fn get_transfer(&self, id: Uuid) -> Result<Reply<TransferState>, ClientError> {
        self.execute(self.get_transfer_call(id)?).await
    }

    fn transfer_call<'k>(
        &self,
        from: &str,
        to: &str,
        amount: i64,
        key: &'k IdempotencyKey,
    ) -> Result<Call<'k>, ClientError> {
        let body = json!({ "from": from, "to": to, "amount": amount });
        self.post_call(&routes::CREATE_TRANSFER.segments(""), &body, key)
    }

    fn get_transfer_call(&self, id: Uuid) -> Result<Call<'static>, ClientError> {
        self.get_call(&routes::GET_TRANSFER.segments(&id.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use reqwest::header::{AUTHORIZATION, CONTENT_TYPE};
    use serde_json::Value;

    use super::*;
    use crate::protocol::{ProblemCode, KEY_HEADER};
    use crate::retry::read_answer;

    /// The `Content-Type` of oncepay's own problems.
    const PROBLEM_JSON: Option<&str> = Some("application/problem+json");

    fn client() -> Client {
        // Building sends nothing: no server is needed to inspect the requests.
        Client::builder("http://127.0.0.1:8130/api", "secret-key")
            .build()
            .unwrap()
    }

    fn build(call: &Call<'_>) -> reqwest::Request {
        client().request(call, Duration::from_secs(1)).build().unwrap()
    }

    fn header<'r>(request: &'r reqwest::Request, name: &str) -> Option<&'r str> {
        request.headers().get(name).map(|v| v.to_str().unwrap())
    }

    #[test]
    fn a_transfer_posts_the_documented_body_with_its_key() {
        let key = IdempotencyKey::parse("transfer-7").unwrap();
        let request = build(&client().transfer_call("u1", "u2", 100, &key).unwrap());

        assert_eq!(request.method(), reqwest::Method::POST);
        assert_eq!(request.url().as_str(), "http://127.0.0.1:8130/api/transfers");
        assert_eq!(header(&request, KEY_HEADER), Some("transfer-7"));
        assert_eq!(header(&request, CONTENT_TYPE.as_str()), Some("application/json"));
        assert_eq!(header(&request, AUTHORIZATION.as_str()), Some("Bearer secret-key"));
        let body: Value = serde_json::from_slice(request.body().unwrap().as_bytes().unwrap()).unwrap();
        assert_eq!(body, json!({ "from": "u1", "to": "u2", "amount": 100 }));
    }

    #[test]
    fn account_ids_travel_in_the_body_as_given() {
        let key = IdempotencyKey::generate();
        let request = build(&client().transfer_call("a/b", "c d", 1, &key).unwrap());
        let body: Value = serde_json::from_slice(request.body().unwrap().as_bytes().unwrap()).unwrap();
        assert_eq!((&body["from"], &body["to"]), (&json!("a/b"), &json!("c d")));
    }

    #[test]
    fn get_transfer_reads_the_transfer_by_its_id_without_a_key() {
        let id = Uuid::parse_str("9b2f4f6e-52c4-4c3a-a0f5-0e4d2f5b8a11").unwrap();
        let request = build(&client().get_transfer_call(id).unwrap());

        assert_eq!(request.method(), reqwest::Method::GET);
        assert_eq!(
            request.url().as_str(),
            "http://127.0.0.1:8130/api/transfers/9b2f4f6e-52c4-4c3a-a0f5-0e4d2f5b8a11"
        );
        assert_eq!(header(&request, KEY_HEADER), None);
        assert!(request.body().is_none());
    }

    #[test]
    fn the_documented_answers_are_read() {
        let created = br#"{"id":"9b2f4f6e-52c4-4c3a-a0f5-0e4d2f5b8a11","from":"u1","to":"u2","amount":100,
            "from_balance":900,"to_balance":100,"created_at":"2026-12-01T02:00:00Z"}"#;
        let reply = read_answer::<Transfer>(201, true, None, created).unwrap();
        assert_eq!((reply.status, reply.replayed), (201, true));
        assert_eq!(
            (reply.value.from.as_str(), reply.value.to.as_str(), reply.value.amount),
            ("u1", "u2", 100)
        );
        assert_eq!((reply.value.from_balance, reply.value.to_balance), (900, 100));

        let state = br#"{"id":"9b2f4f6e-52c4-4c3a-a0f5-0e4d2f5b8a11","from":"u1","to":"u2","amount":100,
            "created_at":"2026-12-01T02:00:00Z"}"#;
        let reply = read_answer::<TransferState>(200, false, None, state).unwrap();
        assert_eq!(
            reply.value.id,
            Uuid::parse_str("9b2f4f6e-52c4-4c3a-a0f5-0e4d2f5b8a11").unwrap()
        );
        assert_eq!(reply.value.created_at.to_rfc3339(), "2026-12-01T02:00:00+00:00");
    }

    #[test]
    fn a_201_without_the_balances_is_an_invalid_response() {
        let body = br#"{"id":"9b2f4f6e-52c4-4c3a-a0f5-0e4d2f5b8a11","from":"u1","to":"u2","amount":100}"#;
        let (error, retryable) = read_answer::<Transfer>(201, false, None, body).unwrap_err();
        assert_eq!((error.code(), retryable), ("invalid_response", false));
    }

    #[test]
    fn transfer_declines_are_final_answers() {
        for code in [
            ProblemCode::InsufficientFunds,
            ProblemCode::AccountNotFound,
            ProblemCode::InvalidRequest,
        ] {
            let body = json!({
                "type": format!("https://oncepay.dev/problems/{code}"),
                "title": "declined",
                "status": code.status(),
                "detail": "declined",
                "code": code,
            });
            let (error, retryable) =
                read_answer::<Transfer>(code.status(), false, PROBLEM_JSON, body.to_string().as_bytes()).unwrap_err();
            assert_eq!((error.status(), error.code()), (Some(code.status()), code.as_str()));
            assert!(!retryable && !error.outcome_unknown(), "{code}");
        }
    }
}
