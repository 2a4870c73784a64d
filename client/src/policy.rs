//! The retry table (docs/api.md, Errors): which failures a retry can
//! fix, and how long the server asks the client to wait.
//!
//! | answer | retried | why |
//! | --- | --- | --- |
//! | connect error, timeout, dropped connection | yes | the request may or may not have been processed: only the same key can tell |
//! | 500, 502, 503, 504 | yes | a transient failure; the server commits nothing on a transient failure (docs/api.md, Idempotency, rule 8) |
//! | any other 5xx not answered by oncepay (a gateway's 520-524, a 501 or 507 page) | yes | the request may have reached the server (a 524 comes after it did): only the same key can tell |
//! | 408 `request_timeout` | yes | the request did not arrive whole in time: nothing was processed |
//! | 429 (`overloaded`, or a proxy's) | yes, after `Retry-After` | the server, or what stands before it, sheds load |
//! | 409 `request_in_progress` | yes, after `Retry-After` | the first request with this key is still running |
//! | 400, 401, 402, 403, 404, 413, 415, 422, other 409s, oncepay's 501 `processor_not_configured`, a redirect, anything else | no | the same request gets the same answer: the caller must change something (one oncepay did not give leaves an operation's outcome unknown: `retry::settled`) |
//! | a server certificate that does not verify (`ClientError::Tls`) | no | the handshake failed, nothing was sent; the next attempt would meet the same certificate |

use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderMap, RETRY_AFTER};

use crate::protocol::ProblemCode;

/// Whether an error answer with this status and problem `code` is worth retrying. `code` is
/// the problem's code when oncepay itself answered ([`crate::Problem::oncepay_code`]); `None`
/// for any other answer, which says nothing about what the server did.
pub fn retryable(status: u16, code: Option<ProblemCode>) -> bool {
    match status {
        500 | 502 | 503 | 504 | 429 | 408 => true,
        409 => code == Some(ProblemCode::RequestInProgress),
        // A 5xx that oncepay did not answer is a gateway's: a 524 comes after the request
        // reached the server (found from outside: reported as refused, and paid twice). With
        // the key every retry is safe. oncepay's own 5xx problems keep their word (501
        // `processor_not_configured` is final).
        500..=599 => code.is_none(),
        _ => false,
    }
}

/// The wait a `Retry-After` header asks for: delay-seconds or an HTTP-date in any of its three
/// forms (RFC 9110 10.2.3 and 5.6.7: IMF-fixdate, and the obsolete RFC 850 and asctime ones a
/// recipient must accept), measured from `now`. An unreadable value is ignored (the backoff
/// applies); delay-seconds too large for 64 bits are a very long wait, the longest there is.
pub fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    // Found from outside: `Retry-After: 99999999999999999999` was read as no header, and the
    // client came back after 35 ms.
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Duration::MAX);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn the_table_retries_transient_statuses_and_in_progress_only() {
        for status in [500, 502, 503, 504, 429, 408] {
            assert!(retryable(status, None), "{status}");
        }
        assert!(retryable(409, Some(ProblemCode::RequestInProgress)));
        assert!(!retryable(409, None), "an unknown 409 is final");
        for status in [501, 505, 507, 520, 521, 522, 523, 524, 599] {
            assert!(retryable(status, None), "a gateway's {status}");
        }
        assert!(!retryable(404, None) && !retryable(400, None), "a 4xx page is final");
        // Every other code of docs/api.md is final.
        for &code in ProblemCode::ALL {
            let expected = matches!(
                code,
                ProblemCode::RequestInProgress
                    | ProblemCode::RequestTimeout
                    | ProblemCode::Overloaded
                    | ProblemCode::TemporarilyUnavailable
                    | ProblemCode::InternalError
            );
            assert_eq!(retryable(code.status(), Some(code)), expected, "{code}");
        }
    }

    fn headers(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777); // Sun, 06 Nov 1994 08:49:37 GMT
        assert_eq!(retry_after(&headers("1"), now), Some(Duration::from_secs(1)));
        assert_eq!(
            retry_after(&headers("Sun, 06 Nov 1994 08:49:40 GMT"), now),
            Some(Duration::from_secs(3))
        );
        assert_eq!(
            retry_after(&headers("Sun, 06 Nov 1994 08:49:00 GMT"), now),
            Some(Duration::ZERO),
            "a date in the past means now"
        );
        assert_eq!(
            retry_after(&headers("Sunday, 06-Nov-94 08:49:40 GMT"), now),
            Some(Duration::from_secs(3)),
            "RFC 850's form"
        );
        assert_eq!(
            retry_after(&headers("Sun Nov  6 08:49:40 1994"), now),
            Some(Duration::from_secs(3)),
            "asctime's form"
        );
        assert_eq!(
            retry_after(&headers("99999999999999999999"), now),
            Some(Duration::MAX),
            "too large for 64 bits: the longest wait, not none"
        );
        assert_eq!(retry_after(&headers("soon"), now), None);
        assert_eq!(retry_after(&headers("-5"), now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }
}
