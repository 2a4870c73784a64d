//! The machine-readable `code` of every problem the server answers (docs/api.md, Errors).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Declares the enum and its table once: variant, wire code, HTTP status.
macro_rules! problem_codes {
    ($($(#[$doc:meta])* $variant:ident = $code:literal, $status:literal;)+) => {
        /// A problem `code`: its wire form is [`ProblemCode::as_str`] (serde: snake_case), and
        /// each code belongs to one HTTP status ([`ProblemCode::status`]).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum ProblemCode {
            $($(#[$doc])* $variant,)+
        }

        impl ProblemCode {
            /// Every code (each has its row in docs/api.md's table).
            pub const ALL: &'static [ProblemCode] = &[$(Self::$variant,)+];

            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $code,)+
                }
            }

            /// The status every answer with this code has.
            pub const fn status(self) -> u16 {
                match self {
                    $(Self::$variant => $status,)+
                }
            }
        }
    };
}

problem_codes! {
    MissingIdempotencyKey = "missing_idempotency_key", 400;
    InvalidIdempotencyKey = "invalid_idempotency_key", 400;
    InvalidJson = "invalid_json", 400;
    /// Wrong type, missing or unknown field, amount out of range, bad account id, a transfer
    /// to its own account.
    InvalidRequest = "invalid_request", 400;
    /// The card processor refused a top-up's payment method as invalid.
    InvalidPaymentMethod = "invalid_payment_method", 400;
    Unauthorized = "unauthorized", 401;
    InsufficientFunds = "insufficient_funds", 402;
    /// The card processor declined a top-up (the problem carries its `decline_code`).
    CardDeclined = "card_declined", 402;
    /// The card processor refused a top-up's refund, or the refund failed there; the amount
    /// was credited back to the account.
    RefundFailed = "refund_failed", 402;
    AdminDisabled = "admin_disabled", 403;
    NotFound = "not_found", 404;
    AccountNotFound = "account_not_found", 404;
    /// The first request with this key is still running: retry after `Retry-After`.
    RequestInProgress = "request_in_progress", 409;
    AccountExists = "account_exists", 409;
    AlreadyRefunded = "already_refunded", 409;
    /// The tenant has `ONCEPAY_WEBHOOK_MAX_ENDPOINTS` webhook endpoints already: delete one first.
    TooManyEndpoints = "too_many_endpoints", 409;
    /// The body (or the request head) did not arrive in time; nothing was processed.
    RequestTimeout = "request_timeout", 408;
    BodyTooLarge = "body_too_large", 413;
    /// The request head exceeds the server's limits; nothing was processed.
    HeadersTooLarge = "headers_too_large", 431;
    UnsupportedMediaType = "unsupported_media_type", 415;
    IdempotencyKeyReused = "idempotency_key_reused", 422;
    IdempotencyKeyExpired = "idempotency_key_expired", 422;
    Overloaded = "overloaded", 429;
    /// A transient failure: nothing was done, or what was done the retry with the same key replays.
    TemporarilyUnavailable = "temporarily_unavailable", 503;
    /// Top-ups need a card processor (`ONCEPAY_PROCESSOR_URL`); not worth a retry.
    ProcessorNotConfigured = "processor_not_configured", 501;
    /// The opaque answer of an unexpected server error.
    InternalError = "internal_error", 500;
}

impl fmt::Display for ProblemCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `code` this version of the protocol does not know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownProblemCode(pub String);

impl fmt::Display for UnknownProblemCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown problem code {:?}", self.0)
    }
}

impl std::error::Error for UnknownProblemCode {}

impl FromStr for ProblemCode {
    type Err = UnknownProblemCode;

    fn from_str(code: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .iter()
            .copied()
            .find(|known| known.as_str() == code)
            .ok_or_else(|| UnknownProblemCode(code.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_and_as_str_spell_every_code_alike() {
        for &code in ProblemCode::ALL {
            let json = serde_json::to_value(code).unwrap();
            assert_eq!(json, code.as_str(), "{code:?}");
            assert_eq!(serde_json::from_value::<ProblemCode>(json).unwrap(), code);
            assert_eq!(code.as_str().parse::<ProblemCode>(), Ok(code));
        }
    }

    #[test]
    fn every_code_has_its_row_in_the_table_of_docs_api_md() {
        let doc = include_str!("../../docs/api.md");
        for &code in ProblemCode::ALL {
            let row = format!("| {} | `{}` |", code.status(), code.as_str());
            assert!(doc.contains(&row), "docs/api.md's table of codes has no row {row}");
        }
    }

    #[test]
    fn the_codes_are_those_of_the_contract_table() {
        let by_status = |status| {
            let mut codes: Vec<&str> = ProblemCode::ALL
                .iter()
                .filter(|c| c.status() == status)
                .map(|c| c.as_str())
                .collect();
            codes.sort_unstable();
            codes
        };
        assert_eq!(
            by_status(400),
            [
                "invalid_idempotency_key",
                "invalid_json",
                "invalid_payment_method",
                "invalid_request",
                "missing_idempotency_key"
            ]
        );
        assert_eq!(by_status(402), ["card_declined", "insufficient_funds", "refund_failed"]);
        assert_eq!(by_status(501), ["processor_not_configured"]);
        assert_eq!(by_status(404), ["account_not_found", "not_found"]);
        assert_eq!(
            by_status(409),
            [
                "account_exists",
                "already_refunded",
                "request_in_progress",
                "too_many_endpoints"
            ]
        );
        assert_eq!(by_status(422), ["idempotency_key_expired", "idempotency_key_reused"]);
        assert_eq!(by_status(431), ["headers_too_large"], "the dispatcher's own refusal");
        assert_eq!(ProblemCode::ALL.len(), 26);
        let distinct: std::collections::HashSet<_> = ProblemCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(distinct.len(), ProblemCode::ALL.len(), "no code twice");
    }

    #[test]
    fn an_unknown_code_is_an_error_not_a_guess() {
        assert_eq!(
            "http_502".parse::<ProblemCode>(),
            Err(UnknownProblemCode("http_502".to_owned()))
        );
    }
}
