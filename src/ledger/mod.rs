//! Money movements: each operation is one call of its SQL function (migrations/V4), which
//! claims the idempotency key and applies the effect in one transaction, and answers with the
//! resource's row. SQL over `&mut PgConnection`, no HTTP types.
//!
//! [`ClaimArgs`] carries what Rust owns (the operation table's entry, the key, the windows);
//! [`settle`] is the one place a function's `(outcome, decline, resource)` becomes an
//! [`Outcome`], for every operation.

mod effects;
pub mod lists;
mod reads;
mod rows;
pub mod top_ups;

use chrono::{DateTime, Utc};

pub use effects::{Batched, Deposit, Effect, OpenAccount, Pay, Refund, SameAccount, Transfer};
pub use reads::{account, key, key_in_flight, payment_state, transfer, KeyHeld, KeyRow};
pub use rows::{AccountRow, DepositRow, PaymentRow, PaymentState, TopUpRow, TransferRow, TransferState};

use crate::idempotency::Claim;
use crate::operation::{ClaimOutcome, Decline, Spec};

/// What the claim of one request tells its SQL function (PostgreSQL `oncepay_claim_args`).
/// In JSON (a rendered statement's argument) as the object `jsonb_populate_record` makes
/// the composite from: the same field names, the fingerprint in `bytea`'s text form.
#[derive(Clone, Debug, sqlx::Type, serde::Serialize)]
#[sqlx(type_name = "oncepay_claim_args")]
pub struct ClaimArgs {
    key: Option<String>,
    derived: bool,
    #[serde(serialize_with = "bytea_text")]
    fingerprint: Option<Vec<u8>>,
    operation: crate::operation::Operation,
    method: String,
    path: String,
    window_secs: i32,
    inflight_wait_ms: i32,
    success_status: i16,
    decline_statuses: serde_json::Value,
}

impl ClaimArgs {
    /// `claim` is `None` for a keyless request under policy `allow`; `path` is the canonical
    /// path with its parameters filled in.
    pub fn new(spec: &Spec, path: String, claim: Option<&Claim>, inflight_wait: std::time::Duration) -> Self {
        Self {
            key: claim.map(|c| c.key.clone()),
            derived: claim.is_some_and(|c| c.derived),
            fingerprint: claim.map(|c| c.fingerprint.to_vec()),
            operation: spec.operation,
            method: spec.method.to_owned(),
            path,
            window_secs: claim.map_or(0, Claim::window_secs),
            inflight_wait_ms: millis(inflight_wait),
            success_status: i16::try_from(spec.success_status).unwrap_or(i16::MAX),
            decline_statuses: spec.decline_statuses(),
        }
    }

    /// Shortens the wait for an in-flight original to at most `wait`; gives the wait it had.
    pub fn cap_inflight_wait(&mut self, wait: std::time::Duration) -> i32 {
        let had = self.inflight_wait_ms;
        self.inflight_wait_ms = had.min(millis(wait));
        had
    }

    /// Takes `spent` (what the item already waited in this process, held back behind a
    /// duplicate of its key or queued for a slot) off the wait for its key's original, so that
    /// a duplicate answers 409 within `ONCEPAY_INFLIGHT_WAIT_MS` of its arrival however it
    /// waited (found from outside: held back 4.5 s, then a full 5 s on the key's row).
    pub fn spend_inflight_wait(&mut self, spent: std::time::Duration) {
        if self.inflight_wait_ms > 0 {
            self.inflight_wait_ms = self.inflight_wait_ms.saturating_sub(millis(spent)).max(1);
        }
    }

    /// Restores a wait given by [`ClaimArgs::cap_inflight_wait`].
    pub fn restore_inflight_wait(&mut self, had: i32) {
        self.inflight_wait_ms = had;
    }

    /// How long a duplicate waits for its key's in-flight original.
    pub fn inflight_wait(&self) -> std::time::Duration {
        std::time::Duration::from_millis(u64::try_from(self.inflight_wait_ms).unwrap_or(0))
    }

    /// The idempotency key (`None` for a keyless request under policy `allow`).
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// The request's fingerprint (`None` for a keyless request under policy `allow`).
    pub fn fingerprint(&self) -> Option<&[u8]> {
        self.fingerprint.as_deref()
    }
}

/// `bytea`'s text input form, `\x` and hexadecimal digits.
fn bytea_text<S: serde::Serializer>(bytes: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
    match bytes {
        Some(bytes) => s.serialize_str(&format!("\\x{}", hex::encode(bytes))),
        None => s.serialize_none(),
    }
}

fn millis(d: std::time::Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX)
}

/// The answer of an operation that was not refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply<T> {
    /// Processed by this request.
    New(T),
    /// The stored result of an earlier request with the same key.
    Replayed(T),
}

/// Why an operation produced no resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    Declined { decline: Decline, replayed: bool },
    KeyReused,
    KeyExpired,
}

/// A reply, with the moment its key stops replaying (`None` without a key).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome<T> {
    pub result: Result<Reply<T>, Refusal>,
    pub expires_at: Option<DateTime<Utc>>,
}

/// Turns a function's `(outcome, decline, resource)` into an [`Outcome`]; a combination the
/// SQL never produces is a decode error (a bug), not an answer.
pub fn settle<R>(
    outcome: ClaimOutcome,
    decline: Option<Decline>,
    expires_at: Option<DateTime<Utc>>,
    resource: Option<R>,
) -> Result<Outcome<R>, sqlx::Error> {
    let result = match (outcome, decline, resource) {
        (ClaimOutcome::Created, None, Some(r)) => Ok(Reply::New(r)),
        (ClaimOutcome::Replayed, None, Some(r)) => Ok(Reply::Replayed(r)),
        (ClaimOutcome::Replayed, Some(decline), None) => Err(Refusal::Declined {
            decline,
            replayed: true,
        }),
        (ClaimOutcome::Declined, Some(decline), None) => Err(Refusal::Declined {
            decline,
            replayed: false,
        }),
        (ClaimOutcome::KeyReused, None, None) => Err(Refusal::KeyReused),
        (ClaimOutcome::Expired, None, None) => Err(Refusal::KeyExpired),
        (outcome, decline, resource) => {
            return Err(sqlx::Error::Decode(
                format!(
                    "impossible result: {outcome:?}, decline {decline:?}, resource present: {}",
                    resource.is_some()
                )
                .into(),
            ))
        }
    };
    Ok(Outcome { result, expires_at })
}
