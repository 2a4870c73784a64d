//! Bearer authentication: tenants by API key, operators by the admin token.

use std::sync::Arc;
use std::time::Duration;

use actix_web::http::header;
use actix_web::{HttpMessage, HttpRequest};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::ApiError;
use crate::tenants::{self, ApiKeyHash, Tenant};

/// How long a replica trusts what it read about an API key. A policy change through
/// `PATCH /admin/tenants/{id}` must hold on every replica within one second (docs/api.md,
/// Idempotency, rule 10), so this stays well under that.
pub const TENANT_CACHE_TTL: Duration = Duration::from_millis(500);

/// API key hash -> tenant (or `None`: no such key, or revoked), shared by the workers of one
/// process. A revoked key is refused once its entry expires: within [`TENANT_CACHE_TTL`].
#[derive(Clone)]
pub struct TenantCache(moka::future::Cache<ApiKeyHash, Option<Tenant>>);

impl TenantCache {
    pub fn new() -> Self {
        Self(
            moka::future::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(TENANT_CACHE_TTL)
                .build(),
        )
    }
}

impl Default for TenantCache {
    fn default() -> Self {
        Self::new()
    }
}

/// The request's one bearer token. Two `Authorization` headers are none: the first one won
/// before (tenant A's key then B's charged A), and which credential a request carries must
/// not depend on the order a proxy put them in.
fn bearer(req: &HttpRequest) -> Option<&str> {
    let mut values = req.headers().get_all(header::AUTHORIZATION);
    let value = values.next()?.to_str().ok()?;
    if values.next().is_some() {
        return None;
    }
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// The request's tenant (401 `unauthorized` without a known API key). Concurrent requests
/// with the same key share one database lookup.
pub async fn tenant(req: &HttpRequest, db: &crate::db::Db, cache: &TenantCache) -> Result<Tenant, ApiError> {
    let token = bearer(req).ok_or(ApiError::Unauthorized)?;
    if !tenants::is_api_key_form(token) {
        return Err(ApiError::Unauthorized);
    }
    let hash = tenants::hash_api_key(token);
    let found = cache
        .0
        .try_get_with(hash, async {
            let found = db.run(async |c| tenants::find_by_key_hash(c, &hash).await).await?;
            if let Some((tenant, key_id)) = found {
                let db = db.clone();
                tokio::spawn(async move { tenants::touch_key(&db, tenant.id, key_id).await });
            }
            Ok::<_, ApiError>(found.map(|(tenant, _)| tenant))
        })
        .await
        .map_err(|err: Arc<ApiError>| match &*err {
            ApiError::Overloaded => ApiError::Overloaded,
            ApiError::InProgress | ApiError::Unavailable | ApiError::OutcomeUnknown => ApiError::Unavailable,
            other => ApiError::Internal(anyhow::anyhow!("tenant lookup failed: {other}")),
        })?;
    let tenant = found.ok_or(ApiError::Unauthorized)?;
    req.extensions_mut().insert(tenant);
    Ok(tenant)
}

/// Checks the admin bearer token in constant time: 403 when the admin API is disabled,
/// 401 when the token is missing or wrong.
pub fn admin(req: &HttpRequest, admin_token: Option<&str>) -> Result<(), ApiError> {
    let expected = admin_token.ok_or(ApiError::AdminDisabled)?;
    let given = bearer(req).ok_or(ApiError::AdminUnauthorized)?;
    // Comparing digests keeps the comparison constant-time in the token's length too.
    let equal = Sha256::digest(given.as_bytes()).ct_eq(&Sha256::digest(expected.as_bytes()));
    if bool::from(equal) {
        Ok(())
    } else {
        Err(ApiError::AdminUnauthorized)
    }
}
