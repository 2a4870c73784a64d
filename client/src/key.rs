//! The client's side of `Idempotency-Key`: one key per logical operation.

use std::fmt;

use uuid::Uuid;

use crate::error::ClientError;
use crate::protocol::{key_header_value, validate_key, KEY_MAX_LEN};

/// The key of one logical operation. Make one per operation ([`IdempotencyKey::generate`], a
/// random UUID) or take the caller's own ([`IdempotencyKey::parse`]), and pass the same
/// value again to resume an operation whose outcome is unknown; never reuse it for
/// another operation (the server answers 422 `idempotency_key_reused`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// A fresh random key (UUID v4).
    pub fn generate() -> Self {
        Self(Uuid::new_v4().to_string())
    }

    /// The caller's key: 1..=255 visible ASCII characters (docs/api.md, Idempotency, rule 1).
    pub fn parse(raw: &str) -> Result<Self, ClientError> {
        validate_key(raw.as_bytes()).map_err(|why| {
            ClientError::InvalidArgument(format!(
                "an idempotency key is 1 to {KEY_MAX_LEN} visible ASCII characters (no spaces): {why}, got {raw:?}"
            ))
        })?;
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The header value the server reads back as exactly this key. The server unquotes a
    /// value that starts and ends with `"` (RFC 8941 string), so such a key is sent quoted.
    pub fn header_value(&self) -> String {
        key_header_value(&self.0)
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_are_distinct_uuids() {
        let (a, b) = (IdempotencyKey::generate(), IdempotencyKey::generate());
        assert_ne!(a, b);
        assert!(Uuid::parse_str(a.as_str()).is_ok());
    }

    #[test]
    fn the_caller_key_follows_the_contract_rule() {
        assert!(IdempotencyKey::parse("order-42").is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
        for bad in ["", "with space", "tab\t", "é", &"k".repeat(256)] {
            let err = IdempotencyKey::parse(bad).unwrap_err();
            assert_eq!(err.code(), "invalid_argument", "{bad:?}");
        }
    }
}
