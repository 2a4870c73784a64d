//! `POST /admin/tenants`, `PATCH /admin/tenants/{id}`, `POST /admin/purge`.

use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::Value;
use utoipa::ToSchema;
use uuid::Uuid;

use super::intake::read_body;
use super::schemas::{
    AdminDisabled, BadRequest, BodyTooLarge, NotFound, Overloaded, RequestTimeout, TenantIn, TenantPatchIn,
    Unauthorized, Unavailable, UnsupportedMediaType,
};
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
    crate::json::parse_strict(&body).map_err(|e| ApiError::InvalidJson(e.to_string()))
}

fn policy_field(value: &Value) -> Result<MissingKeyPolicy, ApiError> {
    value
        .as_str()
        .ok_or_else(|| "`missing_key_policy` must be a string".to_owned())
        .and_then(MissingKeyPolicy::parse)
        .map_err(ApiError::InvalidRequest)
}

/// Creates a tenant with its `main` account; the answer is the only time its API key is shown.
#[utoipa::path(
    post, path = "/admin/tenants", tag = "admin", operation_id = "create_tenant",
    request_body = TenantIn, security(("admin_token" = [])),
    responses(
        (status = 201, description = "Created.", body = tenants::CreatedTenant),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 403, response = AdminDisabled), (status = 408, response = RequestTimeout), (status = 413, response = BodyTooLarge),
        (status = 415, response = UnsupportedMediaType), (status = 429, response = Overloaded),
        (status = 503, response = Unavailable),
    )
)]
pub(super) async fn create_tenant(
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
        // PostgreSQL refuses NUL in text (a 500 if it got there): no control character passes.
        .filter(|n| !n.trim().is_empty() && n.len() <= 200 && !n.chars().any(char::is_control))
        .ok_or_else(|| {
            ApiError::InvalidRequest(
                "`name` must be a non-blank string of at most 200 bytes without control characters".to_owned(),
            )
        })?;
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

/// Changes a tenant's `missing_key_policy`; every replica applies it within one second.
#[utoipa::path(
    patch, path = "/admin/tenants/{tenant_id}", tag = "admin", operation_id = "update_tenant",
    request_body = TenantPatchIn, security(("admin_token" = [])),
    params(("tenant_id" = Uuid, Path, description = "The tenant's id.")),
    responses(
        (status = 200, description = "The tenant.", body = tenants::TenantView),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 403, response = AdminDisabled), (status = 404, response = NotFound),
        (status = 408, response = RequestTimeout), (status = 413, response = BodyTooLarge), (status = 415, response = UnsupportedMediaType),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn update_tenant(
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

/// The answer of a purge run.
#[derive(serde::Serialize, ToSchema)]
struct PurgedOut {
    /// How many expired key rows were deleted.
    deleted: u64,
}

/// Deletes key rows older than the retention (the cron endpoint); takes no body.
#[utoipa::path(
    post, path = "/admin/purge", tag = "admin", operation_id = "purge", security(("admin_token" = [])),
    responses(
        (status = 200, description = "Purged.", body = PurgedOut),
        (status = 401, response = Unauthorized), (status = 403, response = AdminDisabled),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn run_purge(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    auth::admin(&req, state.settings.admin_token.as_deref())?;
    let deleted = purge::purge(&state.pool, state.settings.retention, state.settings.purge_batch_size).await?;
    state.metrics.purged_keys.inc_by(deleted);
    state.metrics.purge_runs.inc();
    Ok(HttpResponse::Ok().json(PurgedOut { deleted }))
}
