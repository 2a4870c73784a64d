//! The idempotency protocol (contract section 5).
//!
//! A client sends one `Idempotency-Key` per logical operation and reuses it on every retry.
//! The server keeps, per (tenant, key), the request's fingerprint and its *result* (status,
//! created resource id, error code) and answers a repeat with that result rebuilt.
//!
//! Order of operations for a tenant POST, each step one of the checks of contract section 6:
//! 1. authenticate (401); read the body within the size limit and check its type (413, 415);
//! 2. parse the key (400) or, without one, apply the tenant's `missing_key_policy`:
//!    `reject` (400), `allow` (no key, no protection) or `fingerprint` (a derived key
//!    `fp:<hex>` with a short window);
//! 3. parse and validate the body (400): nothing is claimed for a malformed request;
//! 4. a key this process saw finish, inside its window, is answered from memory
//!    ([`cache`]): the stored result, or 422 for another fingerprint;
//! 5. call the operation's SQL function (migrations/V4), **one statement, one round trip, one
//!    transaction**, whose claim (`oncepay_claim`, shared by every operation):
//!    - reads the key row first: a finished key answers without any write: expired (422),
//!      another fingerprint (422), or the stored result, rebuilt from the resource it names
//!      (a replay);
//!    - otherwise `INSERT`s the key row, before any account row is locked. A concurrent
//!      duplicate's insert blocks on the unique index `(tenant_id, key)` until the first
//!      transaction ends, then reads the committed row. The wait is bounded by a
//!      `lock_timeout` of `ONCEPAY_INFLIGHT_WAIT_MS` set for this transaction only (so it
//!      holds through a transaction-mode pooler); its expiry is SQLSTATE 55P03, answered 409
//!      `request_in_progress`. Once the key is claimed the timeout is lifted for the rest of
//!      the transaction (the `statement_timeout` still bounds it);
//!    - then the effect runs (debit, refund, deposit, account, transfer) and a deterministic
//!      decline (402, 404, 409) rewrites the key row to the stored failure.
//!
//! What is locked and for how long: the key's index entry and the account row, from the
//! claim to the commit of that single statement (well under a millisecond of work).
//! What a crash leaves behind: nothing. The key row and the effect commit together; a
//! transaction that dies (process killed, connection cut, backend terminated, timeout)
//! rolls back both, so the key is free again and the retry runs for real (503 with
//! `Retry-After` when the server lives to answer).

pub mod cache;
pub mod fingerprint;
pub mod key;

use std::time::Duration;

pub use fingerprint::{fingerprint, Fingerprint};
pub use key::IdempotencyKey;

use crate::domain::MissingKeyPolicy;

/// Prefix of the keys the server derives for keyless requests under policy `fingerprint`.
pub const DERIVED_KEY_PREFIX: &str = "fp:";

/// What the SQL function is asked to claim for one request.
#[derive(Clone, Debug)]
pub struct Claim {
    pub key: String,
    /// A server-derived key: past its window it starts afresh instead of answering "expired".
    pub derived: bool,
    pub fingerprint: Fingerprint,
    pub window: Duration,
}

impl Claim {
    pub fn window_secs(&self) -> i32 {
        i32::try_from(self.window.as_secs()).unwrap_or(i32::MAX)
    }
}

/// A keyless request refused by the tenant's policy `reject`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MissingKey;

/// Step 2: the client's key, or the tenant's decision for a keyless request.
pub fn key_or_policy(
    key: Option<IdempotencyKey>,
    policy: MissingKeyPolicy,
) -> Result<Option<IdempotencyKey>, MissingKey> {
    match (key, policy) {
        (None, MissingKeyPolicy::Reject) => Err(MissingKey),
        (key, _) => Ok(key),
    }
}

/// Windows of the two kinds of key.
#[derive(Clone, Copy, Debug)]
pub struct Windows {
    pub replay: Duration,
    pub fingerprint: Duration,
}

/// Step 4's input: the claim for a request, `None` for a keyless request under `allow`.
pub fn claim_for(
    key: Option<IdempotencyKey>,
    policy: MissingKeyPolicy,
    fingerprint: Fingerprint,
    windows: Windows,
) -> Option<Claim> {
    match (key, policy) {
        (Some(key), _) => Some(Claim {
            key: key.as_str().to_owned(),
            derived: false,
            fingerprint,
            window: windows.replay,
        }),
        (None, MissingKeyPolicy::Fingerprint) => Some(Claim {
            key: format!("{DERIVED_KEY_PREFIX}{}", hex::encode(fingerprint)),
            derived: true,
            fingerprint,
            window: windows.fingerprint,
        }),
        (None, _) => None,
    }
}
