//! Steps 1 to 3 of every tenant POST (see `crate::idempotency`): authentication, body size
//! and type, the key, the JSON body and its fingerprint, in the contract's order.

use std::time::Duration;

use actix_web::http::header;
use actix_web::{web, HttpMessage, HttpRequest};
use serde_json::Value;

use crate::error::ApiError;
use crate::idempotency::{self, Claim, IdempotencyKey};
use crate::startup::AppState;
use crate::tenants::Tenant;

pub struct Intake {
    pub tenant: Tenant,
    pub body: Value,
    /// `None` for a keyless request under policy `allow`.
    pub claim: Option<Claim>,
}

/// Which body a route expects.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum EmptyBody {
    /// An empty body is invalid JSON.
    Refused,
    /// An empty body means `{}` (a refund takes no parameters).
    MeansEmptyObject,
}

/// Authenticates a tenant POST and reads its body, key and fingerprint. `fingerprint_path`
/// is the path the fingerprint covers (`/pay` is fingerprinted as `/payments`).
pub async fn intake(
    req: &HttpRequest,
    payload: web::Payload,
    state: &AppState,
    fingerprint_path: &str,
    empty: EmptyBody,
) -> Result<Intake, ApiError> {
    let tenant = crate::auth::tenant(req, &state.pool, &state.tenants).await?;
    let bytes = read_body(req, payload, state.settings.max_body_bytes).await?;
    let key = IdempotencyKey::from_headers(req.headers()).map_err(ApiError::InvalidIdempotencyKey)?;
    let key = idempotency::key_or_policy(key, tenant.policy)?;
    let body = if bytes.iter().all(u8::is_ascii_whitespace) && empty == EmptyBody::MeansEmptyObject {
        Value::Object(Default::default())
    } else {
        crate::json::parse_strict(&bytes).map_err(|e| ApiError::InvalidJson(e.to_string()))?
    };
    let fingerprint = idempotency::fingerprint("POST", fingerprint_path, &body);
    let claim = idempotency::claim_for(key, tenant.policy, fingerprint, state.windows());
    if claim.is_none() {
        tracing::warn!(tenant = %tenant.id, path = req.path(), "keyless request processed without idempotency protection (policy allow)");
    }
    Ok(Intake { tenant, body, claim })
}

/// How long a whole body may take to arrive. actix's `client_request_timeout` bounds only
/// the headers: without this, a body trickled a byte at a time (slowloris) holds its
/// connection for ever.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads at most `limit` bytes (413 beyond) within [`BODY_READ_TIMEOUT`] (408 beyond) and
/// requires a JSON media type for a non-empty body (415).
pub async fn read_body(req: &HttpRequest, payload: web::Payload, limit: usize) -> Result<web::Bytes, ApiError> {
    // A declared length over the limit is refused before any of the body is awaited: a
    // client announcing a huge body must not hold a worker waiting for bytes it never sends.
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    let read = tokio::time::timeout(BODY_READ_TIMEOUT, payload.to_bytes_limited(limit)).await;
    let bytes = match read.map_err(|_| ApiError::BodyTimeout {
        secs: BODY_READ_TIMEOUT.as_secs(),
    })? {
        Err(_) => return Err(ApiError::BodyTooLarge { limit }),
        Ok(Err(err)) => return Err(ApiError::InvalidJson(format!("the body could not be read: {err}"))),
        Ok(Ok(bytes)) => bytes,
    };
    if !bytes.is_empty() && !is_json(req) {
        return Err(ApiError::UnsupportedMediaType);
    }
    Ok(bytes)
}

fn is_json(req: &HttpRequest) -> bool {
    match req.mime_type() {
        Ok(Some(mime)) => {
            mime.type_() == mime::APPLICATION && (mime.subtype() == mime::JSON || mime.suffix() == Some(mime::JSON))
        }
        _ => false,
    }
}
