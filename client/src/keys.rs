//! `GET /idempotency-keys/{key}` (docs/api.md, "Looking a key up"): what the requests with a key did, so
//! that "did it go through?" needs no guessed id.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::error::ClientError;
use crate::key::IdempotencyKey;
use crate::protocol::routes;
use crate::{Client, Reply};

/// `GET /idempotency-keys/{key}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyInfo {
    pub key: String,
    /// `create_payment`, `refund_payment`, `create_transfer`, ...
    pub operation: String,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub created_at: DateTime<Utc>,
    /// Until when a retry with the key replays its answer.
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub expires_at: DateTime<Utc>,
    /// The status its requests are answered with; `None` while the operation has not ended
    /// (a top-up or its refund whose outcome at the card processor is not known yet: a
    /// retry with the key finishes it).
    pub status: Option<u16>,
    /// A stored decline's problem code; `None` for a success.
    pub code: Option<String>,
    /// What it created or changed; `None` for a stored decline.
    pub resource: Option<KeyResource>,
}

/// The resource a key names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyResource {
    /// `payment`, `transfer`, `account`, `deposit`, `top_up`, `webhook_endpoint`, `event`,
    /// `webhook_recovery`.
    #[serde(rename = "type")]
    pub kind: String,
    pub id: String,
    /// Where `GET` reads it, if it has a `GET` of its own.
    pub path: Option<String>,
}

impl Client {
    /// The key's row: 404 `not_found` for a key the tenant never used (or another tenant's).
    /// The keys `.` and `..` are valid but cannot be looked up here (`InvalidArgument`, nothing
    /// sent: see `Client::endpoint`).
    pub async fn idempotency_key(&self, key: &IdempotencyKey) -> Result<Reply<KeyInfo>, ClientError> {
        let path = routes::GET_IDEMPOTENCY_KEY.segments(key.as_str());
        self.execute(self.get_call(&path)?).await
    }
}
