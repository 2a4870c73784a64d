//! The retry loop: one logical operation, as many attempts as the policy, the deadline and
//! the budget allow, every one with the same method, path, body and key.

use std::time::{Duration, Instant, SystemTime};

use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, LOCATION};
use reqwest::{Method, Url};
use serde::de::DeserializeOwned;

use crate::error::{ClientError, Problem};
use crate::key::IdempotencyKey;
use crate::protocol::{KEY_HEADER, REPLAYED_HEADER};
use crate::{policy, Client, Reply, RetryNote};

/// One logical operation: the body is serialised once, so every attempt sends equal bytes
/// (and so the same fingerprint).
pub(super) struct Call<'a> {
    pub method: Method,
    pub url: Url,
    pub body: Option<Vec<u8>>,
    pub key: Option<&'a IdempotencyKey>,
}

/// A failed attempt: the error, whether the table retries it, and the server's wait.
struct Failed {
    error: ClientError,
    retryable: bool,
    retry_after: Option<Duration>,
}

impl Client {
    pub(super) async fn execute<T: DeserializeOwned>(&self, call: Call<'_>) -> Result<Reply<T>, ClientError> {
        let config = &self.inner.config;
        let deadline = Instant::now() + config.deadline;
        let mut attempt = 0;
        // The first failure that left the outcome unknown (a request that may have been sent):
        // only oncepay's own answer may end the operation as anything else afterwards.
        let mut unknown: Option<String> = None;
        loop {
            attempt += 1;
            let timeout = config
                .attempt_timeout
                .min(deadline.saturating_duration_since(Instant::now()));
            let failed = match self.attempt(&call, timeout).await {
                Ok(reply) => {
                    return Ok(Reply {
                        attempts: attempt,
                        ..reply
                    })
                }
                Err(failed) => failed,
            };
            let last = failed.error;
            let keyed = call.key.is_some();
            if !failed.retryable || attempt >= config.max_attempts {
                return Err(settled(last, unknown, attempt, keyed));
            }
            if unknown.is_none() && last.outcome_unknown() && !last.nothing_sent() {
                unknown = Some(format!("attempt {attempt}: {}: {last}", last.code()));
            }
            let backoff = config.backoff.delay(attempt);
            let wait = wait_before_retry(backoff, failed.retry_after);
            // Compared, not added: a `Retry-After` of 2^64 - 1 seconds overflowed an `Instant`.
            if wait >= deadline.saturating_duration_since(Instant::now()) {
                return Err(ClientError::DeadlineExceeded {
                    deadline: config.deadline,
                    attempts: attempt,
                    server_wait: failed.retry_after.filter(|asked| *asked >= backoff),
                    last: Box::new(settled(last, unknown, attempt, keyed)),
                });
            }
            if let Some(observer) = &self.inner.observer {
                observer(&RetryNote {
                    attempt,
                    error: &last,
                    wait,
                    key: call.key,
                });
            }
            tokio::time::sleep(wait).await;
            // The token is taken when the retry is about to be sent, not before the backoff:
            // then sends, not reservations, are what the bucket spaces out.
            let Some(token_wait) = self.inner.budget.reserve(deadline) else {
                return Err(ClientError::BudgetExhausted {
                    attempts: attempt,
                    last: Box::new(settled(last, unknown, attempt, keyed)),
                });
            };
            tokio::time::sleep(token_wait).await;
        }
    }

    /// The request of one attempt: every attempt of a call sends the same method, URL, key
    /// and body bytes.
    pub(crate) fn request(&self, call: &Call<'_>, timeout: Duration) -> reqwest::RequestBuilder {
        let mut request = self
            .inner
            .http
            .request(call.method.clone(), call.url.clone())
            .header(AUTHORIZATION, self.inner.authorization.clone())
            .timeout(timeout);
        if let Some(key) = call.key {
            request = request.header(KEY_HEADER, key.header_value());
        }
        if let Some(body) = &call.body {
            request = request.header(CONTENT_TYPE, "application/json").body(body.clone());
        }
        request
    }

    async fn attempt<T: DeserializeOwned>(&self, call: &Call<'_>, timeout: Duration) -> Result<Reply<T>, Failed> {
        let response = self.request(call, timeout).send().await.map_err(transport)?;
        let status = response.status().as_u16();
        let replayed = response.headers().get(REPLAYED_HEADER).is_some_and(|v| v == "true");
        let retry_after = policy::retry_after(response.headers(), SystemTime::now());
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        // Redirects are not followed (the operation goes only to the base URL given): where
        // one pointed is what its caller needs to know.
        let location = (300..400)
            .contains(&status)
            .then(|| response.headers().get(LOCATION)?.to_str().ok().map(str::to_owned))
            .flatten();
        // A connection dropped in the middle of the body is a transport failure too.
        let body = response.bytes().await.map_err(transport)?;
        read_answer(status, replayed, content_type.as_deref(), &body).map_err(|(mut error, retryable)| {
            if let (ClientError::Problem(problem), Some(location)) = (&mut error, location) {
                problem.detail = format!("a redirect to {location}, not followed: {}", problem.detail);
            }
            Failed {
                error,
                retryable,
                retry_after,
            }
        })
    }
}

/// The operation's end on `last`, its last failure: after an attempt whose outcome is unknown
/// (`unknown`), an answer that does not speak for the key (a proxy's 4xx page, a certificate
/// refused on a new connection, oncepay's own 401 or 400 given before the key is looked at)
/// does not tell what that attempt did, so the outcome stays unknown (found from outside: a
/// 524 after dropped answers was reported as refused); nor may a last attempt that sent
/// nothing make the whole operation "nothing sent". Nor does a final answer that is not
/// oncepay's (a 4xx page, a redirect) to an operation (`keyed`) tell, even to a first
/// attempt: whatever answered in oncepay's place may have passed the request on before it
/// answered (found from outside: a proxy that forwarded a payment and then answered its own
/// 403 page, and one that answered a 308, were reported as refused, exit 3, the payment made
/// under a key never printed). A read has no outcome to be unknown: its page stays a problem.
fn settled(last: ClientError, unknown: Option<String>, attempts: u32, keyed: bool) -> ClientError {
    let silent = !last.outcome_unknown() || last.nothing_sent();
    if !silent || last.speaks_for_the_key() {
        return last;
    }
    let earlier = match unknown {
        Some(earlier) => earlier,
        None if keyed && last.answered_in_oncepays_place() => {
            format!("attempt {attempts} was answered by something other than oncepay, which may have passed the request on first")
        }
        None => return last,
    };
    ClientError::Unresolved {
        attempts,
        earlier,
        last: Box::new(last),
    }
}

/// The wait before the next attempt: the backoff's (full jitter), or never sooner than the
/// server's `Retry-After`, with up to a quarter of that wait again of the same jitter, so that
/// clients the server asked alike do not come back in lockstep.
pub(crate) fn wait_before_retry(backoff: Duration, retry_after: Option<Duration>) -> Duration {
    match retry_after {
        Some(asked) if asked >= backoff => asked.saturating_add(backoff.min(asked / 4)),
        _ => backoff,
    }
}

/// Reads a whole answer (`content_type`: its `Content-Type`): a success's body as `T`, anything
/// else as a problem, with whether the retry table retries it.
pub(crate) fn read_answer<T: DeserializeOwned>(
    status: u16,
    replayed: bool,
    content_type: Option<&str>,
    body: &[u8],
) -> Result<Reply<T>, (ClientError, bool)> {
    if (200..300).contains(&status) {
        // A 204 (a DELETE) has no body: read as `null`, which `()` takes. Any other empty
        // success (a 204 where a payment is due, found from outside: not retried) is read
        // as it is, a body cut short.
        if status == 204 && body.is_empty() {
            if let Ok(value) = serde_json::from_slice(b"null") {
                return Ok(Reply {
                    value,
                    status,
                    replayed,
                    attempts: 0,
                });
            }
        }
        // Not JSON at all, or cut short (a proxy's own page, a body a proxy truncated): the
        // success may still be real, and a retry with the same key replays it whole. JSON of
        // another shape would be answered the same again: final.
        let value = serde_json::from_slice(body).map_err(|source| {
            let retryable = matches!(
                source.classify(),
                serde_json::error::Category::Syntax | serde_json::error::Category::Eof
            );
            (ClientError::InvalidResponse { status, source }, retryable)
        })?;
        return Ok(Reply {
            value,
            status,
            replayed,
            attempts: 0,
        });
    }
    let problem = Problem::from_answer(status, replayed, content_type, body);
    let retryable = policy::retryable(status, problem.oncepay_code());
    Err((ClientError::Problem(problem), retryable))
}

/// No answer (refused, reset, dropped, timed out): whether the server processed the request
/// is unknown, which is exactly what the key is for.
fn transport(source: reqwest::Error) -> Failed {
    if crate::tls::handshake_refused(&source) {
        return Failed {
            error: ClientError::Tls { source },
            retryable: false,
            retry_after: None,
        };
    }
    Failed {
        error: ClientError::Transport {
            timed_out: source.is_timeout(),
            source,
        },
        retryable: true,
        retry_after: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_after_is_never_shortened_and_gets_a_share_of_the_jitter() {
        let asked = Duration::from_secs(1);
        for backoff_ms in [0, 30, 100, 250, 999] {
            let backoff = Duration::from_millis(backoff_ms);
            let wait = wait_before_retry(backoff, Some(asked));
            assert_eq!(wait, asked + backoff.min(asked / 4), "{backoff_ms} ms");
        }
        // Two clients drawing different jitter come back apart, not in lockstep.
        assert_ne!(
            wait_before_retry(Duration::from_millis(10), Some(asked)),
            wait_before_retry(Duration::from_millis(90), Some(asked))
        );
        // A backoff longer than the server's wait is kept as it is.
        let long = Duration::from_secs(3);
        assert_eq!(wait_before_retry(long, Some(asked)), long);
        assert_eq!(wait_before_retry(long, None), long);
        // The largest header saturates instead of overflowing.
        let huge = Duration::from_secs(u64::MAX);
        assert_eq!(wait_before_retry(Duration::from_secs(5), Some(huge)), Duration::MAX);
    }

    #[test]
    fn a_success_cut_short_or_not_json_is_retried_and_its_outcome_unknown() {
        for body in [&br#"{"id":"9b2f4f6e-52c4"#[..], b"<html>portal</html>", b""] {
            let (error, retryable) = read_answer::<serde_json::Value>(201, false, None, body).unwrap_err();
            assert_eq!((error.code(), retryable), ("invalid_response", true), "{body:?}");
            assert!(error.outcome_unknown());
        }
        for status in [200, 201, 204] {
            let (error, retryable) = read_answer::<crate::Payment>(status, false, None, b"").unwrap_err();
            assert_eq!(
                (error.code(), retryable),
                ("invalid_response", true),
                "an empty {status}"
            );
        }
        let deleted = read_answer::<()>(204, false, None, b"").unwrap();
        assert_eq!(deleted.status, 204, "a DELETE's 204 has no body");
    }

    #[test]
    fn a_5xx_oncepay_did_not_answer_is_retried_and_oncepays_own_final_one_is_not() {
        let own = br#"{"type":"https://oncepay.dev/problems/processor_not_configured","title":"t","status":501,"detail":"d","code":"processor_not_configured"}"#;
        let (error, retryable) =
            read_answer::<serde_json::Value>(501, false, Some("application/problem+json"), own).unwrap_err();
        assert!(!retryable && !error.outcome_unknown(), "oncepay's 501 is final");
        for (status, content_type, body) in [
            (524, Some("text/html"), &b"<html>a timeout occurred</html>"[..]),
            (501, Some("text/plain"), b"not implemented"),
            (501, Some("application/json"), own),
            (507, None, b""),
        ] {
            let (error, retryable) = read_answer::<serde_json::Value>(status, false, content_type, body).unwrap_err();
            assert!(retryable && error.outcome_unknown(), "{status} {content_type:?}");
        }
    }

    #[test]
    fn after_an_unknown_outcome_only_oncepays_own_answer_settles_the_operation() {
        let unknown = Some("attempt 1: transport_error: no answer".to_owned());
        let page = |status| {
            read_answer::<serde_json::Value>(status, false, Some("text/html"), b"<html>")
                .unwrap_err()
                .0
        };
        let settled_page = settled(page(404), unknown.clone(), 2, true);
        assert_eq!(settled_page.code(), "outcome_unknown");
        assert!(settled_page.outcome_unknown());
        for status in [404, 403, 308] {
            let first = settled(page(status), None, 1, true);
            assert_eq!(first.code(), "outcome_unknown", "{status}");
            assert!(
                first.outcome_unknown(),
                "a first attempt's page may come after the request was passed on"
            );
        }
        assert_eq!(
            settled(page(404), None, 1, false).code(),
            "http_404",
            "a read's page is its answer"
        );
        let declined = br#"{"type":"t","title":"t","status":402,"detail":"d","code":"insufficient_funds"}"#;
        let (own, _) =
            read_answer::<serde_json::Value>(402, true, Some("application/problem+json"), declined).unwrap_err();
        let own = settled(own, unknown.clone(), 2, true);
        assert_eq!(own.code(), "insufficient_funds");
        assert!(!own.outcome_unknown(), "oncepay's stored decline settles it");
        // oncepay's own answers given before the key is looked at do not: an API key revoked
        // between two attempts, a body a newer build refuses.
        for (status, code) in [(401, "unauthorized"), (400, "invalid_request"), (413, "body_too_large")] {
            let body = format!(r#"{{"type":"t","title":"t","status":{status},"detail":"d","code":"{code}"}}"#);
            let (before_the_key, _) =
                read_answer::<serde_json::Value>(status, false, Some("application/problem+json"), body.as_bytes())
                    .unwrap_err();
            let ended = settled(before_the_key, unknown.clone(), 2, true);
            assert_eq!(ended.code(), "outcome_unknown", "{code}");
            assert!(ended.outcome_unknown(), "{code}");
        }
        let not_found = br#"{"type":"t","title":"t","status":404,"detail":"d","code":"not_found"}"#;
        let (stored, _) =
            read_answer::<serde_json::Value>(404, true, Some("application/problem+json"), not_found).unwrap_err();
        assert_eq!(
            settled(stored, unknown, 2, true).code(),
            "not_found",
            "a replay speaks for the key"
        );
    }

    #[tokio::test]
    async fn nothing_was_sent_only_when_no_attempt_could_have_sent_it() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let refused = || async { transport(reqwest::get(&url).await.unwrap_err()).error };

        let alone = settled(refused().await, None, 3, true);
        assert!(alone.nothing_sent() && alone.outcome_unknown(), "{alone}");
        let after_a_lost_answer = settled(refused().await, Some("attempt 1: transport_error".to_owned()), 2, true);
        assert_eq!(after_a_lost_answer.code(), "outcome_unknown");
        assert!(!after_a_lost_answer.nothing_sent(), "the first attempt may have paid");
    }
}
