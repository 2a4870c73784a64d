//! `GET /idempotency-keys/{key}` (docs/api.md, "Looking a key up"): "did this request go through?",
//! answered from the key's row as the tenant may see it. Another tenant's key is the same 404
//! as an unknown one: the key space is per tenant (docs/api.md, Idempotency, rule 2).

use actix_web::{web, HttpRequest, HttpResponse};
use chrono::{DateTime, Utc};
use oncepay_protocol::routes;
use serde::Serialize;
use utoipa::ToSchema;

use super::intake::no_query;
use super::schemas::{BadRequest, Conflict, NotFound, Overloaded, Unauthorized, Unavailable};
use crate::domain::time;
use crate::error::ApiError;
use crate::ledger::{self, KeyHeld};
use crate::state::AppState;

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route(routes::GET_IDEMPOTENCY_KEY.path, super::get().to(show));
}

/// An idempotency key and what its requests did.
#[derive(Serialize, ToSchema)]
struct KeyOut {
    key: String,
    /// The operation it was used for (`create_payment`, `refund_payment`, ...).
    operation: &'static str,
    #[serde(serialize_with = "time::rfc3339")]
    created_at: DateTime<Utc>,
    /// Until when a retry with it replays its answer; after that, until the purge, it answers
    /// 422 `idempotency_key_expired`.
    #[serde(serialize_with = "time::rfc3339")]
    expires_at: DateTime<Utc>,
    /// The HTTP status its requests are answered with: the operation's success, or a stored
    /// decline's (see `code`); `null` while the operation has not ended: a top-up (or its
    /// refund) whose outcome at the card processor is not known yet, which a retry with the
    /// key finishes (it may end as a decline).
    status: Option<i16>,
    /// The problem `code` of a stored decline; `null` for a success.
    code: Option<&'static str>,
    /// What the operation created or changed; `null` for a stored decline.
    resource: Option<ResourceOut>,
}

/// A resource named by a key.
#[derive(Serialize, ToSchema)]
struct ResourceOut {
    /// `payment`, `deposit`, `account`, `transfer`, `top_up`, `webhook_endpoint`, `event` or
    /// `webhook_recovery`.
    #[serde(rename = "type")]
    kind: &'static str,
    id: String,
    /// Where `GET` reads it; `null` for a resource without a `GET` of its own (a deposit, a
    /// webhook endpoint, a recovery).
    path: Option<String>,
}

/// An idempotency key of the tenant's: what its requests did.
#[utoipa::path(
    get, path = "/idempotency-keys/{key}", tag = "payments", operation_id = "get_idempotency_key",
    security(("api_key" = [])),
    params(("key" = String, Path, description = "The key, percent-encoded as a path segment (`order/42` as `order%2F42`); \
        another tenant's answers 404 like an unknown one.")),
    responses(
        (status = 200, description = "The key's row.", body = KeyOut),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized), (status = 404, response = NotFound),
        (status = 409, response = Conflict), (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn show(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let tenant = state.tenant(&req).await?;
    no_query(&req)?;
    let raw = req.match_info().get("key").unwrap_or_default();
    let key = percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .ok()
        .filter(|key| oncepay_protocol::validate_key(key.as_bytes()).is_ok())
        // A string that cannot be a key names none.
        .ok_or(ApiError::NotFound)?;
    let mut conn = state.conn().await?;
    let mut row = conn.run(async |c| ledger::key(c, tenant.id, &key).await).await?;
    if row.is_none() {
        // Found from outside: a payment still running (its key row not committed) was
        // answered "never used", which a recovery tool may take for "pay again".
        match conn
            .run(async |c| ledger::key_in_flight(c, tenant.id, &key).await)
            .await?
        {
            KeyHeld::InFlight => return Err(ApiError::KeyInFlight),
            KeyHeld::Present => row = conn.run(async |c| ledger::key(c, tenant.id, &key).await).await?,
            KeyHeld::Absent => {}
        }
    }
    let row = row.ok_or(ApiError::NotFound)?;
    let spec = row.operation.spec();
    let resource = row.resource_id.map(|id| ResourceOut {
        kind: spec.resource.kind,
        path: spec.resource.read.map(|route| route.with_id(&id)),
        id,
    });
    Ok(HttpResponse::Ok().json(KeyOut {
        key: row.key,
        operation: spec.name,
        created_at: row.created_at,
        expires_at: row.expires_at,
        status: row.settled.then_some(row.status),
        code: row.decline.map(|d| d.code().as_str()),
        resource,
    }))
}
