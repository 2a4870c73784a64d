//! Bearer authentication: tenants by API key, operators by the admin token.

use std::collections::HashSet;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use actix_web::http::header;
use actix_web::{HttpMessage, HttpRequest};
use chrono::{DateTime, Utc};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use prometheus::IntCounterVec;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::ApiError;
use crate::tenants::{self, ApiKeyHash, Tenant};
use crate::throttle::Throttle;

/// How long a replica trusts what it read about an API key. A policy change through
/// `PATCH /admin/tenants/{id}` must hold on every replica within one second (docs/api.md,
/// Idempotency, rule 10), so this stays well under that.
pub const TENANT_CACHE_TTL: Duration = Duration::from_millis(500);

/// Look-ups of bearers this process does not know as API keys: at most this many a second,
/// after a burst of [`UNKNOWN_KEY_BURST`]; past it such a bearer is answered 429. Found from
/// outside: a flood of random bearers of the key's form cost a database transaction each and
/// five times the server's CPU of a malformed one (190 against 37 us a request), with no
/// credential at all.
const UNKNOWN_KEY_LOOKUPS_PER_SEC: u32 = 200;
const UNKNOWN_KEY_BURST: u32 = 1_000;

/// How often a replica reads the API keys created since its last read, and how far back
/// each read looks again (a key's `created_at` is its transaction's start, which may precede
/// the read before its commit).
pub const KNOWN_KEYS_EVERY: Duration = Duration::from_secs(5);
const KNOWN_KEYS_OVERLAP: chrono::TimeDelta = chrono::TimeDelta::seconds(60);

/// API key hash -> tenant (or `None`: no such key, or revoked), shared by the workers of one
/// process. A revoked key is refused once its entry expires: within [`TENANT_CACHE_TTL`].
///
/// Beside it, the hashes of the keys this process knows to exist (every key not revoked when
/// it started, those created since as [`keep_known_keys`] reads them, those a look-up found),
/// which decide nothing but how a look-up is paid for: a bearer among them is looked up at
/// once, any other within [`UNKNOWN_KEY_LOOKUPS_PER_SEC`] (a key made a moment ago on
/// another replica included, until the next read).
#[derive(Clone)]
pub struct TenantCache {
    entries: moka::future::Cache<ApiKeyHash, Option<Tenant>>,
    known: Arc<KnownKeys>,
}

struct KnownKeys {
    hashes: RwLock<HashSet<ApiKeyHash>>,
    /// Set by the first complete read: until then every bearer is looked up at once.
    loaded: AtomicBool,
    /// The newest `created_at` read, where the next read starts (less the overlap).
    newest: Mutex<Option<DateTime<Utc>>>,
    unknown: DefaultDirectRateLimiter,
    /// `oncepay_unknown_api_key_lookups_total{outcome}`: `looked_up` or `refused` (429).
    lookups: IntCounterVec,
}

impl TenantCache {
    /// `lookups`: the counter of look-ups of unknown bearers, by outcome.
    pub fn new(lookups: IntCounterVec) -> Self {
        let quota = Quota::per_second(NonZeroU32::new(UNKNOWN_KEY_LOOKUPS_PER_SEC).expect("a positive rate"))
            .allow_burst(NonZeroU32::new(UNKNOWN_KEY_BURST).expect("a positive burst"));
        Self {
            entries: moka::future::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(TENANT_CACHE_TTL)
                .build(),
            known: Arc::new(KnownKeys {
                hashes: RwLock::new(HashSet::new()),
                loaded: AtomicBool::new(false),
                newest: Mutex::new(None),
                unknown: RateLimiter::direct(quota),
                lookups,
            }),
        }
    }

    /// Whether a bearer with this hash may be looked up now: `Err` (429) for one this process
    /// does not know, past the rate of such look-ups.
    fn admit(&self, hash: &ApiKeyHash) -> Result<(), ApiError> {
        let known = &self.known;
        if !known.loaded.load(Ordering::Acquire)
            || known
                .hashes
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(hash)
        {
            return Ok(());
        }
        if known.unknown.check().is_ok() {
            known.lookups.with_label_values(&["looked_up"]).inc();
            Ok(())
        } else {
            known.lookups.with_label_values(&["refused"]).inc();
            Err(ApiError::UnknownKeysThrottled)
        }
    }

    /// A key this replica just made (the admin API): known here at once.
    pub fn know_key(&self, api_key: &str) {
        self.know([tenants::hash_api_key(api_key)]);
    }

    fn know(&self, hashes: impl IntoIterator<Item = ApiKeyHash>) {
        self.known
            .hashes
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(hashes);
    }

    /// Reads the keys created since the last read (all of them the first time) into the
    /// known ones. Its failure is the database's, as it is (found from outside: as an
    /// [`ApiError`] it was logged with a client's words, "retry with the same
    /// Idempotency-Key", and at ERROR as a call that may have committed, for a read).
    pub async fn read_known_keys(&self, db: &crate::db::Db) -> Result<(), crate::db::DbError> {
        let newest = *self.known.newest.lock().unwrap_or_else(PoisonError::into_inner);
        let since = newest.map(|at| at - KNOWN_KEYS_OVERLAP);
        let read = db.run(async |c| tenants::key_hashes(c, since).await).await?;
        if let Some(at) = read.iter().map(|(_, at)| *at).max() {
            let mut newest = self.known.newest.lock().unwrap_or_else(PoisonError::into_inner);
            *newest = (*newest).max(Some(at));
        }
        self.know(read.into_iter().map(|(hash, _)| hash));
        self.known.loaded.store(true, Ordering::Release);
        Ok(())
    }
}

/// Keeps the known keys of `cache` current: a read every [`KNOWN_KEYS_EVERY`], for as long
/// as the server runs (a failed read is tried again at the next).
pub async fn keep_known_keys(db: crate::db::Db, cache: TenantCache) {
    static FAILED: Throttle = Throttle::new(Duration::from_secs(60));
    loop {
        if let Err(err) = cache.read_known_keys(&db).await {
            if let Some(held) = FAILED.admit(std::time::Instant::now()) {
                tracing::warn!(error = %err, held_back = held, "reading the API keys created since the last read failed; tried again in 5 s");
            }
        }
        tokio::time::sleep(KNOWN_KEYS_EVERY).await;
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
    let found = match cache.entries.get(&hash).await {
        Some(found) => found,
        None => {
            cache.admit(&hash)?;
            cache
                .entries
                .try_get_with(hash, async {
                    let found = db.run(async |c| tenants::find_by_key_hash(c, &hash).await).await?;
                    if let Some((tenant, key_id)) = found {
                        cache.know([hash]);
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
                })?
        }
    };
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
