//! `POST /admin/tenants`, `PATCH /admin/tenants/{id}`, the tenant's API keys
//! (`/admin/tenants/{id}/api-keys`), `POST /admin/purge`.

use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use utoipa::ToSchema;

use super::intake::{no_query, parse_body, present, read_body, EmptyBody};
use super::pipeline::{self, json_body, Replay};
use super::schemas::{
    AdminDisabled, BadRequest, BodyTooLarge, IdempotencyKeyHeader, KeyRefused, NotFound, Overloaded, RequestTimeout,
    Unauthorized, Unavailable, UnsupportedMediaType,
};
use crate::domain::{MissingKeyPolicy, OpeningBalance, TenantId};
use crate::error::ApiError;
use crate::idempotency::{self, IdempotencyKey};
use crate::state::AppState;
use crate::tenants::KeyedCreation;
use crate::{purge, tenants};

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/admin/tenants", web::post().to(create_tenant))
        .route("/admin/tenants/{id}", web::patch().to(update_tenant))
        .route("/admin/tenants/{id}/api-keys", web::post().to(create_api_key))
        .route("/admin/tenants/{id}/api-keys", super::get().to(list_api_keys))
        .route(
            "/admin/tenants/{id}/api-keys/{key_id}",
            web::delete().to(revoke_api_key),
        )
        .route("/admin/purge", web::post().to(run_purge))
        // Last: any other admin path or method is judged by the admin token first, as the
        // contract's "admin calls without the bearer: 401" reads (found from outside: 404
        // before any check).
        .route("/admin/{tail:.*}", web::route().to(unknown));
}

/// An admin path or method that is none of the above: 401 or 403 as every admin call, then
/// 404 as an unknown route.
async fn unknown(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    state.admin(&req)?;
    Err(ApiError::NotFound)
}

/// The tenant id of an admin path (an unknown or malformed one: 404, as for any resource).
fn tenant_of(req: &HttpRequest) -> Result<TenantId, ApiError> {
    req.match_info()
        .get("id")
        .and_then(TenantId::parse)
        .ok_or(ApiError::NotFound)
}

/// Adds an API key to the tenant: the answer is the only time it is shown; the tenant's other
/// keys stay valid (rotation: create, move the clients, revoke the old one). Takes no body
/// (empty or `{}`).
#[utoipa::path(
    post, path = "/admin/tenants/{tenant_id}/api-keys", tag = "admin", operation_id = "create_api_key",
    request_body(content = NoParametersIn, description = "None: empty or `{}`."), security(("admin_token" = [])),
    params(("tenant_id" = TenantId, Path, description = "The tenant's id.")),
    responses(
        (status = 201, description = "Created.", body = tenants::CreatedKey),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 403, response = AdminDisabled), (status = 404, response = NotFound),
        (status = 408, response = RequestTimeout), (status = 413, response = BodyTooLarge),
        (status = 415, response = UnsupportedMediaType), (status = 429, response = Overloaded),
        (status = 503, response = Unavailable),
    )
)]
pub(super) async fn create_api_key(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    admin_no_body(&req, payload, &state).await?;
    let tenant = tenant_of(&req)?;
    let created = tenants::create_key(&state.db, tenant)
        .await?
        .ok_or(ApiError::NotFound)?;
    state.tenants.know_key(&created.api_key);
    Ok(HttpResponse::Created().json(created))
}

/// The tenant's API keys: ids, creation, last use (to the tenant cache's resolution) and
/// revocation; never a secret.
#[utoipa::path(
    get, path = "/admin/tenants/{tenant_id}/api-keys", tag = "admin", operation_id = "list_api_keys",
    security(("admin_token" = [])),
    params(("tenant_id" = TenantId, Path, description = "The tenant's id.")),
    responses(
        (status = 200, description = "The keys, oldest first.", body = [tenants::KeyView]),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized), (status = 403, response = AdminDisabled),
        (status = 404, response = NotFound), (status = 429, response = Overloaded),
        (status = 503, response = Unavailable),
    )
)]
pub(super) async fn list_api_keys(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    state.admin(&req)?;
    no_query(&req)?;
    let tenant = tenant_of(&req)?;
    let keys = tenants::list_keys(&state.db, tenant).await?.ok_or(ApiError::NotFound)?;
    Ok(HttpResponse::Ok().json(keys))
}

/// Revokes one of the tenant's API keys: every replica refuses it within one second.
#[utoipa::path(
    delete, path = "/admin/tenants/{tenant_id}/api-keys/{key_id}", tag = "admin", operation_id = "revoke_api_key",
    security(("admin_token" = [])),
    params(
        ("tenant_id" = TenantId, Path, description = "The tenant's id."),
        ("key_id" = uuid::Uuid, Path, description = "The key's id."),
    ),
    responses(
        (status = 200, description = "The key, revoked.", body = tenants::KeyView),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized), (status = 403, response = AdminDisabled),
        (status = 404, response = NotFound), (status = 429, response = Overloaded),
        (status = 503, response = Unavailable),
    )
)]
pub(super) async fn revoke_api_key(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    state.admin(&req)?;
    no_query(&req)?;
    let tenant = tenant_of(&req)?;
    let key_id = req
        .match_info()
        .get("key_id")
        .and_then(|k| uuid::Uuid::parse_str(k).ok())
        .ok_or(ApiError::NotFound)?;
    let key = tenants::revoke_key(&state.db, tenant, key_id)
        .await?
        .ok_or(ApiError::NotFound)?;
    Ok(HttpResponse::Ok().json(key))
}

/// Body of `POST /admin/tenants`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantIn {
    /// Not blank, at most 200 bytes of UTF-8, no control characters.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$"
    )]
    pub name: String,
    /// `reject` when absent.
    #[schema(nullable = false)]
    #[serde(default, deserialize_with = "present")]
    pub missing_key_policy: Option<MissingKeyPolicy>,
    /// The opening balance of the tenant's `main` account; 0 when absent.
    #[schema(nullable = false)]
    #[serde(default, deserialize_with = "present")]
    pub main_balance: Option<OpeningBalance>,
}

/// Body of `PATCH /admin/tenants/{tenant_id}`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantPatchIn {
    pub missing_key_policy: MissingKeyPolicy,
}

/// Admin bodies: the same size and type rules as tenant bodies, no idempotency key (the
/// tenant's creation reads its own: `create_tenant`).
async fn admin_body<T: DeserializeOwned>(
    req: &HttpRequest,
    payload: web::Payload,
    state: &AppState,
) -> Result<T, ApiError> {
    state.admin(req)?;
    no_query(req)?;
    let bytes = read_body(req, payload, state.settings.max_body_bytes).await?;
    parse_body(&bytes, EmptyBody::Refused).map(|(_, body)| body)
}

/// The body of an admin call that takes none: empty or `{}`, like a tenant's refund; anything
/// else is refused (400, 415) before the call acts, not ignored.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NoParametersIn {}

async fn admin_no_body(req: &HttpRequest, payload: web::Payload, state: &AppState) -> Result<(), ApiError> {
    state.admin(req)?;
    no_query(req)?;
    let bytes = read_body(req, payload, state.settings.max_body_bytes).await?;
    parse_body::<NoParametersIn>(&bytes, EmptyBody::MeansEmptyObject).map(|_| ())
}

/// A tenant's creation as answered: `tenants::CreatedTenant`, whose API key a replay cannot show.
#[derive(serde::Serialize, ToSchema)]
pub struct TenantCreatedOut {
    tenant_id: TenantId,
    name: String,
    /// `opk_...`, shown this once; `null` on the replay of a creation by its
    /// `Idempotency-Key` (the key is stored only as its hash: if it was lost, create another
    /// with `POST /admin/tenants/{tenant_id}/api-keys`).
    api_key: Option<String>,
    missing_key_policy: MissingKeyPolicy,
}

/// Creates a tenant with its `main` account; the answer is the only time its API key is shown.
/// With an `Idempotency-Key`, once: a retry with the key answers the same tenant (201,
/// `Idempotency-Replayed: true`) with `api_key: null`, never a second tenant or balance.
#[utoipa::path(
    post, path = "/admin/tenants", tag = "admin", operation_id = "create_tenant",
    request_body = TenantIn, security(("admin_token" = [])), params(IdempotencyKeyHeader),
    responses(
        (status = 201, description = "Created, or with an `Idempotency-Key` the key's tenant again (`Idempotency-Replayed: true`, `api_key` null).", body = TenantCreatedOut,
         headers(("Idempotency-Replayed" = String, description = "`true` on a replay, `false` on a first answer; absent without a key"))),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 403, response = AdminDisabled), (status = 408, response = RequestTimeout), (status = 413, response = BodyTooLarge),
        (status = 415, response = UnsupportedMediaType), (status = 422, response = KeyRefused),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn create_tenant(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    state.admin(&req)?;
    no_query(&req)?;
    let bytes = read_body(&req, payload, state.settings.max_body_bytes).await?;
    let key = IdempotencyKey::from_headers(req.headers()).map_err(ApiError::InvalidIdempotencyKey)?;
    let (value, body): (_, TenantIn) = parse_body(&bytes, EmptyBody::Refused)?;
    let name = tenants::check_name(&body.name).map_err(ApiError::InvalidRequest)?;
    let policy = body.missing_key_policy.unwrap_or(MissingKeyPolicy::Reject);
    let main_balance = body.main_balance.unwrap_or_default();
    let Some(key) = key else {
        let created = tenants::create(&state.db, name, policy, main_balance).await?;
        state.tenants.know_key(&created.api_key);
        return Ok(HttpResponse::Created().json(created));
    };
    let creation = tenants::CreationKey {
        key: key.as_str(),
        fingerprint: idempotency::fingerprint("POST", "/admin/tenants", &value),
        window: state.settings.replay_window,
    };
    let (created, replay) = match tenants::create_keyed(&state.db, name, policy, main_balance, &creation).await? {
        KeyedCreation::New(created) => {
            state.tenants.know_key(&created.api_key);
            (
                TenantCreatedOut {
                    tenant_id: created.tenant_id,
                    name: created.name,
                    api_key: Some(created.api_key),
                    missing_key_policy: created.missing_key_policy,
                },
                Replay::New,
            )
        }
        // The same fingerprint: the same body, so the same name and policy.
        KeyedCreation::Replayed(tenant_id) => (
            TenantCreatedOut {
                tenant_id,
                name: name.to_owned(),
                api_key: None,
                missing_key_policy: policy,
            },
            Replay::Replayed,
        ),
        KeyedCreation::Reused => return Err(ApiError::KeyReused),
        KeyedCreation::Expired => return Err(ApiError::KeyExpired),
    };
    Ok(pipeline::answer(
        StatusCode::CREATED,
        json_body(&created)?,
        None,
        replay,
    ))
}

/// Changes a tenant's `missing_key_policy`; every replica applies it within one second.
#[utoipa::path(
    patch, path = "/admin/tenants/{tenant_id}", tag = "admin", operation_id = "update_tenant",
    request_body = TenantPatchIn, security(("admin_token" = [])),
    params(("tenant_id" = TenantId, Path, description = "The tenant's id.")),
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
    let body: TenantPatchIn = admin_body(&req, payload, &state).await?;
    let id = req
        .match_info()
        .get("id")
        .and_then(TenantId::parse)
        .ok_or(ApiError::NotFound)?;
    let tenant = tenants::set_policy(&state.db, id, body.missing_key_policy)
        .await?
        .ok_or(ApiError::NotFound)?;
    Ok(HttpResponse::Ok().json(tenant))
}

/// The answer of a purge run.
#[derive(serde::Serialize, ToSchema)]
struct PurgedOut {
    /// How many expired key rows were deleted.
    deleted: u64,
    /// How many webhook events past `ONCEPAY_EVENT_RETENTION_DAYS` were deleted, with their
    /// deliveries and attempts (found from outside: a run that deleted 1.56 million webhook
    /// rows answered `{"deleted": 0}`).
    events_deleted: u64,
}

/// Deletes key rows older than the retention (the cron endpoint); takes no body (empty or `{}`).
#[utoipa::path(
    post, path = "/admin/purge", tag = "admin", operation_id = "purge",
    request_body(content = NoParametersIn, description = "None: empty or `{}`."), security(("admin_token" = [])),
    responses(
        (status = 200, description = "Purged.", body = PurgedOut),
        (status = 400, response = BadRequest), (status = 401, response = Unauthorized),
        (status = 403, response = AdminDisabled), (status = 408, response = RequestTimeout),
        (status = 413, response = BodyTooLarge), (status = 415, response = UnsupportedMediaType),
        (status = 429, response = Overloaded), (status = 503, response = Unavailable),
    )
)]
pub(super) async fn run_purge(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    admin_no_body(&req, payload, &state).await?;
    let purged = purge::purge(
        &state.db,
        purge::Retention::of(&state.settings),
        state.settings.purge_batch_size,
    )
    .await?;
    state.metrics.record_purge(purged.keys);
    Ok(HttpResponse::Ok().json(PurgedOut {
        deleted: purged.keys,
        events_deleted: purged.events,
    }))
}
