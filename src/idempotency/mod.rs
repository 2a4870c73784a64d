//! The idempotency protocol (docs/api.md, Idempotency).
//!
//! A client sends one `Idempotency-Key` per logical operation and reuses it on every retry.
//! The server keeps, per (tenant, key), the request's fingerprint and its *result* (status,
//! created resource id, error code) and answers a repeat with that result rebuilt.
//!
//! Order of operations for a tenant POST, each step one of the checks of docs/api.md, Errors:
//! 1. authenticate (401); read the body within the size limit and check its type (413, 415);
//! 2. parse the key (400) or, without one, apply the tenant's `missing_key_policy`:
//!    `reject` (400), `allow` (no key, no protection) or `fingerprint` (a derived key
//!    `fp:<hex>` with a short window);
//! 3. parse and validate the body (400): nothing is claimed for a malformed request;
//! 4. a key this process saw finish, inside its window, is answered from memory
//!    ([`cache`]): the stored result, or 422 for another fingerprint;
//! 5. call the operation's SQL function (migrations/V4 to V6), **one call, in one transaction**.
//!    A refund, a deposit, a transfer or a new account is a statement of its own (one round
//!    trip, one commit); so is a payment at low load, but under load payments that arrive
//!    while the server's payment statements are out share one statement, one transaction and
//!    one commit, each its own `oncepay_pay` call with its own answer (`crate::batch`). The
//!    claim (`oncepay_claim`, shared by every operation):
//!    - reads the key row first: a finished key answers without any write: expired (422),
//!      another fingerprint (422), or the stored result, rebuilt from the resource it names
//!      (a replay);
//!    - otherwise `INSERT`s the key row, before any account row is locked. A concurrent
//!      duplicate's insert blocks on the unique index `(tenant_id, key)` until the first
//!      transaction ends, then reads the committed row. The wait is bounded by a
//!      `lock_timeout` of `ONCEPAY_INFLIGHT_WAIT_MS` set for this transaction only (so it
//!      holds through a transaction-mode pooler); its expiry is SQLSTATE 55P03, answered 409
//!      `request_in_progress`. Once the key is claimed the timeout is lifted for the rest of
//!      the transaction (the `statement_timeout` still bounds it). In a batch the wait is at
//!      most 200 ms (the duplicate holds its batch's earlier rows meanwhile), after which the
//!      batch is rolled back and its payments run again one by one, the duplicate with its
//!      full wait; a duplicate of a payment still out in the same process is held back
//!      before the database instead, for as long;
//!    - then the effect runs (debit, refund, deposit, account, transfer) and a deterministic
//!      decline (402, 404, 409) rewrites the key row to the stored failure.
//!
//! What is locked and for how long: the key's index entry and the account row, from the
//! claim to the commit of the statement (well under a millisecond of work for one call; in
//! a batch, until the batch commits). Every statement takes account rows in one order,
//! (tenant, account id) as bytes, so none waits on another in a cycle.
//! What a crash leaves behind: nothing half done. The key row and the effect commit
//! together; a transaction that dies before its commit (process killed, connection cut,
//! backend terminated, timeout) rolls back both, so the key is free again and the retry
//! runs for real. When the server cannot tell whether the commit happened (the connection
//! broke while the call was out, or its answer could not be read) it answers 503 with
//! `Retry-After` and runs nothing again: the client's retry with the same key replays the
//! commit if there was one, and runs for real if there was not. A keyless request under
//! `allow` has no such retry: its client must find out before it sends again.

pub mod cache;
pub mod fingerprint;
pub mod key;

use std::time::Duration;

pub use fingerprint::{fingerprint, Fingerprint};
pub use key::IdempotencyKey;

use crate::domain::MissingKeyPolicy;

/// Prefix of the keys the server derives for keyless requests under policy `fingerprint`
/// (reserved: a client's key with it is refused, `oncepay_protocol::parse_key_header`).
pub use oncepay_protocol::DERIVED_KEY_PREFIX;

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
