//! Verifying oncepay's webhooks on the receiving side (docs/webhooks.md).
//!
//! oncepay signs every delivery as Standard Webhooks v1 prescribes: the headers
//! `webhook-id` (the event's id, the same on every attempt), `webhook-timestamp` (Unix
//! seconds of this attempt) and `webhook-signature` (one or more `v1,<base64>` separated by
//! spaces: two during a secret's rotation), the signature being HMAC-SHA256 over
//! `{id}.{timestamp}.{body}` keyed by the base64-decoded part of the endpoint's secret after
//! `whsec_`.
//!
//! ```
//! use oncepay_client::webhooks::{sign, verify_at, Verified};
//! let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
//! let body = br#"{"type":"payment.succeeded","timestamp":"2026-01-01T00:00:00Z","data":{}}"#;
//! let signature = sign(secret, "evt_1", 1_700_000_000, body).unwrap();
//! let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_010);
//! let verified: Verified = verify_at(secret, "evt_1", "1700000000", &signature, body, at).unwrap();
//! assert_eq!(verified.webhook_id, "evt_1");
//! ```
//!
//! A verified message may still be a duplicate (delivery is at least once): keep the
//! `webhook-id`s you processed for at least the whole retry span (about 31 hours with the
//! default schedule), and answer 2xx to one you already processed.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// How far `webhook-timestamp` may be from the receiver's clock (Standard Webhooks' default):
/// an older message is refused as a possible replay by a third party.
pub const TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// Why a message is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error("the secret is not a `whsec_` secret")]
    BadSecret,
    #[error("`webhook-timestamp` is not a Unix time in seconds")]
    BadTimestamp,
    #[error("`webhook-timestamp` is more than five minutes away from now")]
    TimestampOutOfTolerance,
    #[error("no `v1` signature of `webhook-signature` matches")]
    NoMatchingSignature,
}

/// A message whose signature verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub webhook_id: String,
    pub timestamp: i64,
}

fn mac(secret: &str, id: &str, timestamp: &str, body: &[u8]) -> Result<Hmac<Sha256>, VerifyError> {
    let key = secret
        .strip_prefix("whsec_")
        .and_then(|k| STANDARD.decode(k).ok())
        .filter(|k| !k.is_empty())
        .ok_or(VerifyError::BadSecret)?;
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).map_err(|_| VerifyError::BadSecret)?;
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    Ok(mac)
}

/// The `webhook-signature` value oncepay sends for this message with this secret (for
/// tests of a receiver).
pub fn sign(secret: &str, webhook_id: &str, timestamp: i64, body: &[u8]) -> Result<String, VerifyError> {
    let mac = mac(secret, webhook_id, &timestamp.to_string(), body)?;
    Ok(format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes())))
}

/// Verifies a message against the receiver's clock: pass the three headers as received and
/// the body's exact bytes (before any JSON parsing).
pub fn verify(
    secret: &str,
    webhook_id: &str,
    webhook_timestamp: &str,
    webhook_signature: &str,
    body: &[u8],
) -> Result<Verified, VerifyError> {
    verify_at(
        secret,
        webhook_id,
        webhook_timestamp,
        webhook_signature,
        body,
        SystemTime::now(),
    )
}

/// [`verify`] with the receiver's clock given.
pub fn verify_at(
    secret: &str,
    webhook_id: &str,
    webhook_timestamp: &str,
    webhook_signature: &str,
    body: &[u8],
    now: SystemTime,
) -> Result<Verified, VerifyError> {
    let timestamp: i64 = webhook_timestamp
        .trim()
        .parse()
        .map_err(|_| VerifyError::BadTimestamp)?;
    let now = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    if (now - timestamp).unsigned_abs() > TOLERANCE.as_secs() {
        return Err(VerifyError::TimestampOutOfTolerance);
    }
    let mac = mac(secret, webhook_id, webhook_timestamp.trim(), body)?;
    for candidate in webhook_signature.split_whitespace() {
        let Some(encoded) = candidate.strip_prefix("v1,") else {
            continue; // another scheme (e.g. v1a): not ours to check
        };
        let Ok(signature) = STANDARD.decode(encoded) else {
            continue;
        };
        // Constant-time comparison.
        if mac.clone().verify_slice(&signature).is_ok() {
            return Ok(Verified {
                webhook_id: webhook_id.to_owned(),
                timestamp,
            });
        }
    }
    Err(VerifyError::NoMatchingSignature)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const BODY: &[u8] = br#"{"test": 2432232314}"#;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    /// The reference libraries' example (standard-webhooks/libraries).
    #[test]
    fn verifies_the_reference_example() {
        let signature = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
        assert_eq!(sign(SECRET, ID, 1614265330, BODY).unwrap(), signature);
        assert!(verify_at(SECRET, ID, "1614265330", signature, BODY, at(1614265330)).is_ok());
    }

    #[test]
    fn refuses_a_changed_body_id_timestamp_or_secret() {
        let signature = sign(SECRET, ID, 1614265330, BODY).unwrap();
        let now = at(1614265330);
        let refused = |secret, id, ts, body: &[u8]| verify_at(secret, id, ts, &signature, body, now).unwrap_err();
        assert_eq!(
            refused(SECRET, ID, "1614265330", b"{}"),
            VerifyError::NoMatchingSignature
        );
        assert_eq!(
            refused(SECRET, "msg_other", "1614265330", BODY),
            VerifyError::NoMatchingSignature
        );
        assert_eq!(
            refused(SECRET, ID, "1614265331", BODY),
            VerifyError::NoMatchingSignature
        );
        assert_eq!(
            refused("whsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", ID, "1614265330", BODY),
            VerifyError::NoMatchingSignature
        );
        assert_eq!(refused("nope", ID, "1614265330", BODY), VerifyError::BadSecret);
        assert_eq!(
            verify_at(SECRET, ID, "1614265330", &signature, BODY, at(1614265330 + 301)).unwrap_err(),
            VerifyError::TimestampOutOfTolerance
        );
    }

    #[test]
    fn any_of_several_signatures_may_match_during_a_rotation() {
        let good = sign(SECRET, ID, 1614265330, BODY).unwrap();
        let header = format!("v1,AAAA {good} v1a,ignored");
        assert!(verify_at(SECRET, ID, "1614265330", &header, BODY, at(1614265330)).is_ok());
    }
}

/// `POST /webhook-endpoints`: 201, with the endpoint's secret (shown in this answer only).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WebhookEndpoint {
    pub id: uuid::Uuid,
    pub url: String,
    pub events: Vec<String>,
    /// `true` for an endpoint created without `events`: every type, present and future
    /// (`events` lists today's).
    #[serde(default)]
    pub all_events: bool,
    /// `whsec_...`: what [`verify`] takes. `None` only on a replay (a retry with the same key)
    /// after the secret was rotated: a replay never shows a secret its first answer did not.
    pub secret: Option<String>,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// `GET /webhook-endpoints`: one endpoint, never its secret.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ListedEndpoint {
    pub id: uuid::Uuid,
    pub url: String,
    pub events: Vec<String>,
    /// `true` for an endpoint created without `events`: every type, present and future
    /// (`events` lists today's).
    #[serde(default)]
    pub all_events: bool,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// `enabled` or `disabled`.
    pub status: String,
    #[serde(serialize_with = "crate::time::rfc3339_opt")]
    pub disabled_at: Option<chrono::DateTime<chrono::Utc>>,
    /// `gone` (the receiver answered 410) or `failing` (no attempt succeeded for the server's
    /// `ONCEPAY_WEBHOOK_DISABLE_AFTER_SECS` while attempts kept failing).
    pub disabled_reason: Option<String>,
}

/// `POST /webhook-endpoints/{id}/enable`: 200, the endpoint as of that request.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EnabledEndpoint {
    pub id: uuid::Uuid,
    pub url: String,
    pub events: Vec<String>,
    /// `true` for an endpoint created without `events`: every type, present and future
    /// (`events` lists today's).
    #[serde(default)]
    pub all_events: bool,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// `enabled`.
    pub status: String,
}

/// `POST /webhook-endpoints/{id}/rotate-secret`: 200.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RotatedSecret {
    pub id: uuid::Uuid,
    /// The new secret; the previous one signs too until `previous_secret_expires_at`. `None`
    /// only on a replay once the secret was rotated again.
    pub secret: Option<String>,
    #[serde(serialize_with = "crate::time::rfc3339_opt")]
    pub previous_secret_expires_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// `GET /events/{id}`: an event as delivered (`id` is its `webhook-id`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Event {
    pub id: uuid::Uuid,
    #[serde(rename = "type")]
    pub event_type: String,
    pub timestamp: String,
    pub data: serde_json::Value,
}

impl crate::Client {
    /// The tenant's endpoints.
    pub async fn webhook_endpoints(&self) -> Result<crate::Reply<Vec<ListedEndpoint>>, crate::ClientError> {
        let path = crate::protocol::routes::LIST_WEBHOOK_ENDPOINTS.segments("");
        self.execute(self.get_call(&path)?).await
    }

    /// Deletes an endpoint (204). Retried after a lost answer, the retry may find it deleted
    /// already: 404 `not_found`.
    pub async fn delete_webhook_endpoint(&self, id: uuid::Uuid) -> Result<crate::Reply<()>, crate::ClientError> {
        let id = id.to_string();
        let call = crate::retry::Call {
            method: reqwest::Method::DELETE,
            url: self.endpoint(&crate::protocol::routes::DELETE_WEBHOOK_ENDPOINT.segments(&id))?,
            body: None,
            key: None,
        };
        self.execute(call).await
    }

    /// Gives the endpoint a new secret; the previous one keeps signing for `overlap_secs`
    /// (the server's default, a day, when `None`).
    pub async fn rotate_webhook_secret(
        &self,
        id: uuid::Uuid,
        overlap_secs: Option<u32>,
        key: &crate::IdempotencyKey,
    ) -> Result<crate::Reply<RotatedSecret>, crate::ClientError> {
        let id = id.to_string();
        let body = match overlap_secs {
            Some(secs) => serde_json::json!({ "overlap_secs": secs }),
            None => serde_json::json!({}),
        };
        let call = self.post_call(
            &crate::protocol::routes::ROTATE_WEBHOOK_SECRET.segments(&id),
            &body,
            key,
        )?;
        self.execute(call).await
    }

    /// Enables a disabled endpoint: deliveries resume, first the events kept while it was
    /// disabled. 404 `not_found` for an unknown or deleted endpoint.
    pub async fn enable_webhook_endpoint(
        &self,
        id: uuid::Uuid,
        key: &crate::IdempotencyKey,
    ) -> Result<crate::Reply<EnabledEndpoint>, crate::ClientError> {
        let id = id.to_string();
        let call = self.post_call(
            &crate::protocol::routes::ENABLE_WEBHOOK_ENDPOINT.segments(&id),
            &serde_json::json!({}),
            key,
        )?;
        self.execute(call).await
    }

    /// An event, as delivered.
    pub async fn event(&self, id: uuid::Uuid) -> Result<crate::Reply<Event>, crate::ClientError> {
        let id = id.to_string();
        let path = crate::protocol::routes::GET_EVENT.segments(&id);
        self.execute(self.get_call(&path)?).await
    }

    /// Registers an endpoint for the tenant's events (`events`: `None` for every type).
    pub async fn create_webhook_endpoint(
        &self,
        url: &str,
        events: Option<&[&str]>,
        key: &crate::IdempotencyKey,
    ) -> Result<crate::Reply<WebhookEndpoint>, crate::ClientError> {
        let mut body = serde_json::json!({ "url": url });
        if let Some(events) = events {
            body["events"] = serde_json::json!(events);
        }
        let call = self.post_call(
            &crate::protocol::routes::CREATE_WEBHOOK_ENDPOINT.segments(""),
            &body,
            key,
        )?;
        self.execute(call).await
    }
}
