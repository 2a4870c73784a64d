//! `oncepay-protocol`: the rules the client and the server share, written once (both depend
//! on this crate; the client re-exports it as `oncepay_client::protocol`): the header names,
//! the `Idempotency-Key` syntax (docs/api.md, Idempotency, rule 1), the problem codes (docs/api.md,
//! Errors) and the routes ([`routes`]).
//!
//! Nothing here knows HTTP libraries: the server reads its actix headers and the client
//! writes its reqwest headers with these names and rules. It depends on serde alone (the
//! problem codes' wire form), so neither side pulls in the other's crates through it.

mod codes;
mod key;
pub mod routes;

pub use codes::{ProblemCode, UnknownProblemCode};
pub use key::{key_header_value, parse_key_header, validate_key, KeySyntaxError, DERIVED_KEY_PREFIX, KEY_MAX_LEN};

/// The request header that carries the key of a logical operation.
pub const KEY_HEADER: &str = "Idempotency-Key";

/// The response header marking an answer the server had stored for this key (`true`), not
/// a second effect. First answers carry `false` or nothing.
pub const REPLAYED_HEADER: &str = "Idempotency-Replayed";
