//! Delivery repaired by the merchant (docs/webhooks.md, "Delivering again"):
//! `POST /webhook-endpoints/{id}/events/{event_id}/resend` and
//! `POST /webhook-endpoints/{id}/recover`, keyed like every POST (a retry with the same key
//! never delivers twice more). The attempts are listed by [`Client::webhook_attempts`],
//! enabling is [`Client::enable_webhook_endpoint`].

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

use crate::error::ClientError;
use crate::key::IdempotencyKey;
use crate::protocol::routes;
use crate::{Client, Reply};

/// `POST /webhook-endpoints/{id}/events/{event_id}/resend`: 202.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resent {
    pub endpoint_id: Uuid,
    /// The event, delivered again with it as its `webhook-id`.
    pub event_id: Uuid,
}

/// `POST /webhook-endpoints/{id}/recover`: 202.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recovery {
    pub id: Uuid,
    pub endpoint_id: Uuid,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub since: DateTime<Utc>,
    /// Deliveries made due again (given up or waiting for a retry), each with a new retry
    /// schedule; held until enabled for a disabled endpoint.
    pub deliveries: u64,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub created_at: DateTime<Utc>,
}

impl Client {
    /// Delivers the event once more to the endpoint, with its `webhook-id`, in its place among
    /// its resource's events not yet delivered. 404 `not_found` for an event the endpoint was
    /// never sent, or an unknown or deleted endpoint.
    pub async fn resend_webhook_event(
        &self,
        endpoint: Uuid,
        event: Uuid,
        key: &IdempotencyKey,
    ) -> Result<Reply<Resent>, ClientError> {
        let (endpoint, event) = (endpoint.to_string(), event.to_string());
        let path = routes::RESEND_WEBHOOK_EVENT.segments_with(&[&endpoint, &event]);
        self.execute(self.post_call(&path, &json!({}), key)?).await
    }

    /// Delivers again every event created since `since` (whole seconds) that the endpoint was
    /// sent and never acknowledged with a 2xx.
    pub async fn recover_webhook_endpoint(
        &self,
        endpoint: Uuid,
        since: DateTime<Utc>,
        key: &IdempotencyKey,
    ) -> Result<Reply<Recovery>, ClientError> {
        let endpoint = endpoint.to_string();
        let path = routes::RECOVER_WEBHOOK_ENDPOINT.segments(&endpoint);
        let body = json!({ "since": since.timestamp() });
        self.execute(self.post_call(&path, &body, key)?).await
    }
}
