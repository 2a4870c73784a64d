//! Tenants and their API keys. Keys are random (256 bits) and stored only as SHA-256
//! hashes: a fast hash is enough for a secret that cannot be guessed, and it lets a request
//! find its tenant with one index lookup.

use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::RngCore;
use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::PgConnection;

use crate::db::{Db, DbError};
use crate::domain::{AccountId, MissingKeyPolicy, OpeningBalance, TenantId};
use crate::idempotency::fingerprint::Fingerprint;

pub const API_KEY_PREFIX: &str = "opk_";

pub type ApiKeyHash = [u8; 32];

/// Bytes of randomness in an API key: written as twice as many lowercase hex digits.
const API_KEY_SECRET_BYTES: usize = 32;

pub fn hash_api_key(api_key: &str) -> ApiKeyHash {
    Sha256::digest(api_key.as_bytes()).into()
}

/// Whether `token` has the form every API key has (`opk_` and 64 lowercase hex digits). A
/// bearer of any other form is refused without a database look-up, so that random bearers
/// cost an attacker more than they cost the database.
pub fn is_api_key_form(token: &str) -> bool {
    token.strip_prefix(API_KEY_PREFIX).is_some_and(|secret| {
        secret.len() == 2 * API_KEY_SECRET_BYTES && secret.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// What an authenticated request knows about its tenant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tenant {
    pub id: TenantId,
    pub policy: MissingKeyPolicy,
}

/// The answer to a tenant's creation: the only time its API key is shown.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct CreatedTenant {
    pub tenant_id: TenantId,
    pub name: String,
    pub api_key: String,
    pub missing_key_policy: MissingKeyPolicy,
}

/// An admin's `Idempotency-Key` on a tenant's creation, with the request's fingerprint.
pub struct CreationKey<'a> {
    pub key: &'a str,
    pub fingerprint: Fingerprint,
    /// How long a retry with the key replays (`ONCEPAY_REPLAY_WINDOW_SECS`).
    pub window: Duration,
}

/// What a creation with a key did.
#[derive(Debug)]
pub enum KeyedCreation {
    New(CreatedTenant),
    /// The key's tenant exists, made by a request with this fingerprint, in its window.
    Replayed(TenantId),
    /// The key made a tenant from another request (another body).
    Reused,
    /// The key made a tenant, and its replay window has passed.
    Expired,
}

/// The id of the tenant an admin's creation key makes: SHA-256 of the key (in a namespace of
/// its own) as a version 8 UUID. The tenants' primary key is then the key's claim.
pub fn creation_id(key: &str) -> TenantId {
    let digest = Sha256::new_with_prefix(b"oncepay admin tenant creation\n")
        .chain_update(key.as_bytes())
        .finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    TenantId::from_uuid(uuid::Builder::from_custom_bytes(bytes).into_uuid())
}

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct TenantView {
    pub tenant_id: TenantId,
    pub name: String,
    pub missing_key_policy: MissingKeyPolicy,
}

/// Checks a tenant's name as the admin API and `oncepay tenant create` both take it: not
/// blank, at most 200 bytes, no control character (PostgreSQL refuses NUL in text). Found from
/// outside: the command took a blank name the API refused, and answered an empty or long one
/// with the database's CHECK violation, printed twice.
pub fn check_name(name: &str) -> Result<&str, String> {
    if name.trim().is_empty() || name.len() > 200 || name.chars().any(char::is_control) {
        return Err("`name` must be a non-blank string of at most 200 bytes without control characters".to_owned());
    }
    Ok(name)
}

/// Creates a tenant with its `main` account, in one transaction.
pub async fn create(
    db: &Db,
    name: &str,
    policy: MissingKeyPolicy,
    main_balance: OpeningBalance,
) -> Result<CreatedTenant, DbError> {
    let api_key = new_api_key();
    let tenant_id = TenantId::new_random();
    let api_key_hash = hash_api_key(&api_key);
    db.transaction(async |tx| {
        sqlx::query!(
            "INSERT INTO tenants (tenant_id, name, api_key_hash, missing_key_policy) VALUES ($1, $2, $3, $4)",
            tenant_id.get(),
            name,
            &api_key_hash[..],
            policy.as_str(),
        )
        .execute(&mut *tx)
        .await?;
        insert_key_and_main(tx, tenant_id, &api_key_hash, main_balance).await
    })
    .await?;
    Ok(CreatedTenant {
        tenant_id,
        name: name.to_owned(),
        api_key,
        missing_key_policy: policy,
    })
}

/// Creates a tenant as [`create`] does, once per admin key: its id is the key's
/// ([`creation_id`]), so a concurrent duplicate's insert waits for the first transaction on
/// the tenants' primary key, then reads what the first stored.
pub async fn create_keyed(
    db: &Db,
    name: &str,
    policy: MissingKeyPolicy,
    main_balance: OpeningBalance,
    key: &CreationKey<'_>,
) -> Result<KeyedCreation, DbError> {
    let api_key = new_api_key();
    let tenant_id = creation_id(key.key);
    let api_key_hash = hash_api_key(&api_key);
    let window_secs = key.window.as_secs_f64();
    let made = db
        .transaction(async |tx| {
            let inserted = sqlx::query!(
                "INSERT INTO tenants (tenant_id, name, api_key_hash, missing_key_policy,
                                      creation_fingerprint, creation_expires_at)
                 VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6))
                 ON CONFLICT (tenant_id) DO NOTHING",
                tenant_id.get(),
                name,
                &api_key_hash[..],
                policy.as_str(),
                &key.fingerprint[..],
                window_secs,
            )
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if inserted == 1 {
                insert_key_and_main(tx, tenant_id, &api_key_hash, main_balance).await?;
                return Ok(None);
            }
            let stored = sqlx::query!(
                r#"SELECT creation_fingerprint, creation_expires_at < now() AS "expired!"
                     FROM tenants WHERE tenant_id = $1"#,
                tenant_id.get(),
            )
            .fetch_one(&mut *tx)
            .await?;
            Ok(Some(match stored.creation_fingerprint {
                Some(fingerprint) if fingerprint != key.fingerprint => KeyedCreation::Reused,
                Some(_) if stored.expired => KeyedCreation::Expired,
                Some(_) => KeyedCreation::Replayed(tenant_id),
                // A tenant of this id made without a key: no creation of this key's.
                None => KeyedCreation::Reused,
            }))
        })
        .await?;
    Ok(made.unwrap_or_else(|| {
        KeyedCreation::New(CreatedTenant {
            tenant_id,
            name: name.to_owned(),
            api_key,
            missing_key_policy: policy,
        })
    }))
}

fn new_api_key() -> String {
    let mut secret = [0u8; API_KEY_SECRET_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut secret);
    format!("{API_KEY_PREFIX}{}", hex::encode(secret))
}

/// The new tenant's first API key and its `main` account, in its creation's transaction.
async fn insert_key_and_main(
    tx: &mut PgConnection,
    tenant_id: TenantId,
    api_key_hash: &ApiKeyHash,
    main_balance: OpeningBalance,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "INSERT INTO api_keys (tenant_id, key_id, key_hash) VALUES ($1, $2, $3)",
        tenant_id.get(),
        uuid::Uuid::new_v4(),
        &api_key_hash[..],
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query!(
                "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance) VALUES ($1, $2::text, $3::bigint, $3::bigint)",
                tenant_id.get(),
                AccountId::MAIN,
                main_balance.get(),
            )
            .execute(&mut *tx)
            .await?;
    Ok(())
}

pub async fn set_policy(db: &Db, tenant_id: TenantId, policy: MissingKeyPolicy) -> Result<Option<TenantView>, DbError> {
    let row = db
        .run(async |c| {
            sqlx::query!(
                "UPDATE tenants SET missing_key_policy = $2 WHERE tenant_id = $1 RETURNING name",
                tenant_id.get(),
                policy.as_str(),
            )
            .fetch_optional(c)
            .await
        })
        .await?;
    Ok(row.map(|r| TenantView {
        tenant_id,
        name: r.name,
        missing_key_policy: policy,
    }))
}

/// The tenant whose API key, not revoked, has this hash; with the key's id.
pub async fn find_by_key_hash(
    conn: &mut PgConnection,
    hash: &ApiKeyHash,
) -> Result<Option<(Tenant, uuid::Uuid)>, sqlx::Error> {
    let row = sqlx::query!(
        "SELECT t.tenant_id, t.missing_key_policy, k.key_id
           FROM api_keys k JOIN tenants t ON t.tenant_id = k.tenant_id
          WHERE k.key_hash = $1 AND k.revoked_at IS NULL",
        &hash[..],
    )
    .fetch_optional(conn)
    .await?;
    row.map(|r| {
        let policy = MissingKeyPolicy::parse(&r.missing_key_policy).map_err(|e| sqlx::Error::Decode(e.into()))?;
        Ok((
            Tenant {
                id: TenantId::from_uuid(r.tenant_id),
                policy,
            },
            r.key_id,
        ))
    })
    .transpose()
}

/// The hashes of the API keys not revoked that were created after `since` (all of them
/// without it), each with its `created_at`: what a replica knows to exist
/// ([`crate::auth::TenantCache`]).
pub async fn key_hashes(
    conn: &mut PgConnection,
    since: Option<DateTime<Utc>>,
) -> Result<Vec<(ApiKeyHash, DateTime<Utc>)>, sqlx::Error> {
    let rows = sqlx::query!(
        "SELECT key_hash, created_at FROM api_keys
          WHERE revoked_at IS NULL AND created_at > coalesce($1, '-infinity'::timestamptz)",
        since,
    )
    .fetch_all(conn)
    .await?;
    rows.into_iter()
        .map(|r| {
            let hash = ApiKeyHash::try_from(r.key_hash.as_slice())
                .map_err(|_| sqlx::Error::Decode("an API key hash of other than 32 bytes".into()))?;
            Ok((hash, r.created_at))
        })
        .collect()
}

/// Records that the key was used (best effort: called when a replica looks the key up, at
/// most once per tenant-cache lifetime; an error is only logged).
pub async fn touch_key(db: &Db, tenant: TenantId, key_id: uuid::Uuid) {
    let done = db
        .run(async |c| {
            sqlx::query!(
                "UPDATE api_keys SET last_used_at = now() WHERE tenant_id = $1 AND key_id = $2",
                tenant.get(),
                key_id,
            )
            .execute(c)
            .await
        })
        .await;
    if let Err(err) = done {
        tracing::debug!(error = %err, "could not record an API key's last use");
    }
}

/// An API key as the admin API shows it: never its secret.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct KeyView {
    pub key_id: uuid::Uuid,
    // Six digits of fraction, as every time in an answer (found by a flaky test: chrono's own
    // `Serialize` wrote `.12Z` for a time of 120,000 µs).
    #[serde(serialize_with = "crate::domain::time::rfc3339")]
    pub created_at: chrono::DateTime<chrono::Utc>,
    #[serde(serialize_with = "crate::domain::time::rfc3339_opt")]
    pub last_used_at: Option<chrono::DateTime<chrono::Utc>>,
    #[serde(serialize_with = "crate::domain::time::rfc3339_opt")]
    pub revoked_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// A new API key: the only time its secret is shown.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct CreatedKey {
    pub key_id: uuid::Uuid,
    pub api_key: String,
    #[serde(serialize_with = "crate::domain::time::rfc3339")]
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// Adds an API key to the tenant (the others stay valid); `None` for an unknown tenant.
pub async fn create_key(db: &Db, tenant: TenantId) -> Result<Option<CreatedKey>, DbError> {
    let mut secret = [0u8; API_KEY_SECRET_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut secret);
    let api_key = format!("{API_KEY_PREFIX}{}", hex::encode(secret));
    let hash = hash_api_key(&api_key);
    let key_id = uuid::Uuid::new_v4();
    let row = db
        .run(async |c| {
            sqlx::query!(
                "INSERT INTO api_keys (tenant_id, key_id, key_hash)
                 SELECT tenant_id, $2, $3 FROM tenants WHERE tenant_id = $1
                 RETURNING created_at",
                tenant.get(),
                key_id,
                &hash[..],
            )
            .fetch_optional(c)
            .await
        })
        .await?;
    Ok(row.map(|r| CreatedKey {
        key_id,
        api_key,
        created_at: r.created_at,
    }))
}

/// The tenant's API keys, oldest first; `None` for an unknown tenant.
pub async fn list_keys(db: &Db, tenant: TenantId) -> Result<Option<Vec<KeyView>>, DbError> {
    let rows = db
        .run(async |c| {
            sqlx::query!(
                r#"SELECT k.key_id AS "key_id?", k.created_at AS "created_at?", k.last_used_at, k.revoked_at
                     FROM tenants t LEFT JOIN api_keys k ON k.tenant_id = t.tenant_id
                    WHERE t.tenant_id = $1
                    ORDER BY k.created_at, k.key_id"#,
                tenant.get(),
            )
            .fetch_all(c)
            .await
        })
        .await?;
    if rows.is_empty() {
        return Ok(None);
    }
    Ok(Some(
        rows.into_iter()
            .filter_map(|r| {
                Some(KeyView {
                    key_id: r.key_id?,
                    created_at: r.created_at?,
                    last_used_at: r.last_used_at,
                    revoked_at: r.revoked_at,
                })
            })
            .collect(),
    ))
}

/// Revokes one of the tenant's keys (again: no change); `None` when the tenant has no such
/// key. Every replica refuses it once its tenant cache forgets it (`auth::TENANT_CACHE_TTL`).
pub async fn revoke_key(db: &Db, tenant: TenantId, key_id: uuid::Uuid) -> Result<Option<KeyView>, DbError> {
    let row = db
        .run(async |c| {
            sqlx::query!(
                "UPDATE api_keys SET revoked_at = coalesce(revoked_at, now())
                  WHERE tenant_id = $1 AND key_id = $2
                 RETURNING key_id, created_at, last_used_at, revoked_at",
                tenant.get(),
                key_id,
            )
            .fetch_optional(c)
            .await
        })
        .await?;
    Ok(row.map(|r| KeyView {
        key_id: r.key_id,
        created_at: r.created_at,
        last_used_at: r.last_used_at,
        revoked_at: r.revoked_at,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_form_of_a_made_key_is_an_api_key_form() {
        let made = format!("{API_KEY_PREFIX}{}", "0123456789abcdef".repeat(4));
        assert!(is_api_key_form(&made));
        for wrong in [
            String::new(),
            "opk_".to_owned(),
            made[..made.len() - 1].to_owned(),
            format!("{made}0"),
            made.to_uppercase(),
            made.replacen("opk_", "sk_", 1),
            made.replacen('a', "g", 1),
            made.replacen('a', "é", 1),
        ] {
            assert!(!is_api_key_form(&wrong), "{wrong:?}");
        }
    }
}
