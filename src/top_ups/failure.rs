//! What the processor's refusals and final statuses mean for a top-up: the processor's error
//! `type` and `code` decide, the HTTP status only when they say nothing (docs/top-ups.md).
//!
//! | the processor says | the top-up's `failure_code` | the answer (its key row) |
//! | --- | --- | --- |
//! | 402, or `type` `card_error` | `card_declined` | 402 `card_declined` |
//! | `amount_too_small`, `amount_too_large` | `invalid_request` | 400 `invalid_request` |
//! | `param` `payment_method`, a `payment_method_*` code | `invalid_payment_method` | 400 `invalid_payment_method` |
//! | any other 4xx (409 and 429 aside: they decided nothing) | `invalid_request` | 400 `invalid_request` |
//! | the action timeout passed in `requires_action` / `requires_capture` | `authentication_required` / `capture_required` | 402 `card_declined` |
//! | the PaymentIntent `canceled` by someone else | `canceled` | 402 `card_declined` |
//!
//! The processor's own reason (its `decline_code`, its `code`, `http_<status>` when its answer
//! carries neither, or the cancellation's reason) is the top-up's `decline_code`, shown in the
//! problem. A refusal never comes from a look (a GET): what a look cannot read is unknown.

use super::processor::{ErrorObject, Intent};
use crate::operation::Decline;

/// A top-up's failure, owned (the driver hands it to `ledger::top_ups::fail`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub failure: &'static str,
    pub decline: Decline,
    pub decline_code: Option<String>,
}

/// The codes of an amount the processor will not charge.
const AMOUNT_CODES: [&str; 3] = ["amount_too_small", "amount_too_large", "invalid_charge_amount"];

/// A create or a confirmation the processor refused with `status` (a 4xx) and `error`.
pub fn of_refusal(status: u16, error: &ErrorObject) -> Failure {
    let code = error.code.as_deref();
    let reason = error
        .decline_code
        .clone()
        .or_else(|| error.code.clone())
        .or_else(|| Some(format!("http_{status}")));
    if status == 402 || error.kind.as_deref() == Some("card_error") {
        return Failure {
            failure: "card_declined",
            decline: Decline::CardDeclined,
            decline_code: reason,
        };
    }
    if code.is_some_and(|c| AMOUNT_CODES.contains(&c)) {
        return Failure {
            failure: "invalid_request",
            decline: Decline::InvalidRequest,
            decline_code: reason,
        };
    }
    let about_the_payment_method =
        error.param.as_deref() == Some("payment_method") || code.is_some_and(|c| c.starts_with("payment_method_"));
    if about_the_payment_method {
        return Failure {
            failure: "invalid_payment_method",
            decline: Decline::InvalidPaymentMethod,
            decline_code: reason,
        };
    }
    Failure {
        failure: "invalid_request",
        decline: Decline::InvalidRequest,
        decline_code: reason,
    }
}

/// A PaymentIntent whose confirmation failed (`requires_payment_method`): a decline.
pub fn declined(intent: &Intent) -> Failure {
    let error = intent.last_payment_error.clone().unwrap_or_default();
    Failure {
        failure: "card_declined",
        decline: Decline::CardDeclined,
        decline_code: error
            .decline_code
            .or(error.code)
            .or_else(|| Some("payment_failed".to_owned())),
    }
}

/// A PaymentIntent canceled while it waited in `waited` for the action timeout (by oncepay),
/// or canceled by someone else.
pub fn canceled(intent: &Intent, waited: Option<&str>) -> Failure {
    let failure = match waited {
        Some("requires_action") => "authentication_required",
        Some("requires_capture") => "capture_required",
        _ => "canceled",
    };
    let reason = match failure {
        "canceled" => intent
            .cancellation_reason
            .clone()
            .unwrap_or_else(|| "canceled".to_owned()),
        other => other.to_owned(),
    };
    Failure {
        failure,
        decline: Decline::CardDeclined,
        decline_code: Some(reason),
    }
}

/// The decline a top-up's `failure_code` answers with (what its key row stores).
pub fn decline_of(failure_code: &str) -> Decline {
    match failure_code {
        "invalid_payment_method" => Decline::InvalidPaymentMethod,
        "invalid_request" => Decline::InvalidRequest,
        _ => Decline::CardDeclined,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(kind: &str, code: Option<&str>, param: Option<&str>) -> ErrorObject {
        ErrorObject {
            kind: Some(kind.to_owned()),
            code: code.map(str::to_owned),
            param: param.map(str::to_owned),
            ..ErrorObject::default()
        }
    }

    #[test]
    fn the_code_decides_before_the_status() {
        let small = of_refusal(
            400,
            &error("invalid_request_error", Some("amount_too_small"), Some("amount")),
        );
        assert_eq!(
            (small.failure, small.decline),
            ("invalid_request", Decline::InvalidRequest)
        );
        assert_eq!(small.decline_code.as_deref(), Some("amount_too_small"));

        let missing = of_refusal(
            404,
            &error(
                "invalid_request_error",
                Some("resource_missing"),
                Some("payment_method"),
            ),
        );
        assert_eq!(missing.decline, Decline::InvalidPaymentMethod);

        let declined = of_refusal(402, &error("card_error", Some("card_declined"), None));
        assert_eq!(declined.decline, Decline::CardDeclined);
    }

    #[test]
    fn an_unexpected_4xx_is_an_invalid_request_with_the_processors_code() {
        // A mistyped base URL: Stripe's 404 names no payment method.
        let unrouted = of_refusal(404, &error("invalid_request_error", None, None));
        assert_eq!(unrouted.decline, Decline::InvalidRequest);
        assert_eq!(unrouted.decline_code.as_deref(), Some("http_404"));
        let unknown = of_refusal(
            400,
            &error("invalid_request_error", Some("parameter_unknown"), Some("foo")),
        );
        assert_eq!(unknown.decline_code.as_deref(), Some("parameter_unknown"));
    }

    #[test]
    fn every_failure_code_answers_with_a_documented_code() {
        for (code, decline) in [
            ("card_declined", Decline::CardDeclined),
            ("authentication_required", Decline::CardDeclined),
            ("capture_required", Decline::CardDeclined),
            ("canceled", Decline::CardDeclined),
            ("invalid_payment_method", Decline::InvalidPaymentMethod),
            ("invalid_request", Decline::InvalidRequest),
        ] {
            assert_eq!(decline_of(code), decline, "{code}");
        }
    }
}
