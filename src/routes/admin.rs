//! `POST /admin/tenants`, `PATCH /admin/tenants/{id}`, `POST /admin/purge`.

use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::Value;
use uuid::Uuid;

use super::intake::read_body;
use crate::domain::{object_fields, required, MissingKeyPolicy, OpeningBalance};
use crate::error::ApiError;
use crate::startup::AppState;
use crate::{auth, purge, tenants};

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/admin/tenants", web::post().to(create_tenant))
        .route("/admin/tenants/{id}", web::patch().to(update_tenant))
        .route("/admin/purge", web::post().to(run_purge));
}

/// Admin bodies: the same size and type rules as tenant bodies, no idempotency key (a
/// repeated tenant creation creates another tenant, as the operator asked).
async fn admin_body(req: &HttpRequest, payload: web::Payload, state: &AppState) -> Result<Value, ApiError> {
    auth::admin(req, state.settings.admin_token.as_deref())?;
    let body = read_body(req, payload, state.settings.max_body_bytes).await?;
    serde_json::from_slice(&body).map_err(|e| ApiError::InvalidJson(e.to_string()))
}

fn policy_field(value: &Value) -> Result<MissingKeyPolicy, ApiError> {
    value
        .as_str()
        .ok_or_else(|| "`missing_key_policy` must be a string".to_owned())
        .and_then(MissingKeyPolicy::parse)
        .map_err(ApiError::InvalidRequest)
}

async fn create_tenant(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let body = admin_body(&req, payload, &state).await?;
    let fields =
        object_fields(&body, &["name", "missing_key_policy", "main_balance"]).map_err(ApiError::InvalidRequest)?;
    let name = required(fields, "name")
        .map_err(ApiError::InvalidRequest)?
        .as_str()
        .filter(|n| !n.trim().is_empty() && n.len() <= 200)
        .ok_or_else(|| ApiError::InvalidRequest("`name` must be a non-empty string of at most 200 bytes".to_owned()))?;
    let policy = fields
        .get("missing_key_policy")
        .map(policy_field)
        .transpose()?
        .unwrap_or(MissingKeyPolicy::Reject);
    let main_balance = fields
        .get("main_balance")
        .map(|b| OpeningBalance::parse("main_balance", b))
        .transpose()
        .map_err(ApiError::InvalidRequest)?
        .unwrap_or_default();
    let created = tenants::create(&state.pool, name, policy, main_balance).await?;
    Ok(HttpResponse::Created().json(created))
}

async fn update_tenant(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let body = admin_body(&req, payload, &state).await?;
    let fields = object_fields(&body, &["missing_key_policy"]).map_err(ApiError::InvalidRequest)?;
    let policy = policy_field(required(fields, "missing_key_policy").map_err(ApiError::InvalidRequest)?)?;
    let id = req
        .match_info()
        .get("id")
        .and_then(|id| Uuid::parse_str(id).ok())
        .ok_or(ApiError::NotFound)?;
    let tenant = tenants::set_policy(&state.pool, id, policy)
        .await?
        .ok_or(ApiError::NotFound)?;
    Ok(HttpResponse::Ok().json(tenant))
}

async fn run_purge(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    auth::admin(&req, state.settings.admin_token.as_deref())?;
    let deleted = purge::purge(&state.pool, state.settings.retention, state.settings.purge_batch_size).await?;
    state.metrics.purged_keys.inc_by(deleted);
    state.metrics.purge_runs.inc();
    Ok(HttpResponse::Ok().json(serde_json::json!({ "deleted": deleted })))
}
