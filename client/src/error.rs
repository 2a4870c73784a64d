//! What a failed operation tells its caller: a problem answered by the server (with its
//! status and `code`), or why no answer came.

use std::time::Duration;

use serde::Deserialize;

use crate::protocol::ProblemCode;

/// An RFC 9457 problem answered by the server (or a non-problem error answer, whose `code`
/// is then `http_<status>`). Whatever answers in the server's place (a gateway's 520-524, a
/// load balancer's page) gives one too: [`Problem::from_oncepay`] tells them apart.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Problem {
    #[serde(skip)]
    pub status: u16,
    pub code: String,
    #[serde(default)]
    pub title: String,
    #[serde(default)]
    pub detail: String,
    /// A top-up's refusal by the card processor: the processor's own reason
    /// (`card_declined`, `invalid_request`, `invalid_payment_method`; docs/top-ups.md).
    #[serde(default)]
    pub decline_code: Option<String>,
    /// A stored failure replayed for a retried key (`Idempotency-Replayed: true`).
    #[serde(skip)]
    pub replayed: bool,
    /// oncepay itself answered: `application/problem+json` with a `code` of oncepay's, at that
    /// code's status. Any other answer (a gateway's 524 after the request reached the server,
    /// a proxy's own JSON) says nothing about what the server did.
    #[serde(skip)]
    pub from_oncepay: bool,
}

impl Problem {
    /// Reads an error answer (`content_type`: its `Content-Type`); a body that is not a problem
    /// still yields a problem with the status, so every failure has a `code`.
    pub fn from_answer(status: u16, replayed: bool, content_type: Option<&str>, body: &[u8]) -> Self {
        let parsed = serde_json::from_slice::<Problem>(body).ok();
        let mut problem = parsed.unwrap_or_else(|| Problem {
            status,
            code: format!("http_{status}"),
            title: String::new(),
            detail: String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
            decline_code: None,
            replayed,
            from_oncepay: false,
        });
        problem.status = status;
        problem.replayed = replayed;
        let problem_json = content_type
            .and_then(|t| t.split(';').next())
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/problem+json"));
        problem.from_oncepay = problem_json && problem.known_code().is_some_and(|code| code.status() == status);
        problem
    }

    /// The `code` when oncepay itself answered it ([`Problem::from_oncepay`]); `None` for any
    /// other answer. The retry table ([`crate::policy::retryable`]) takes this.
    pub fn oncepay_code(&self) -> Option<ProblemCode> {
        self.known_code().filter(|_| self.from_oncepay)
    }

    /// The `code` as a [`ProblemCode`]; `None` for a code this client does not know (a newer
    /// server's, or `http_<status>`).
    pub fn known_code(&self) -> Option<ProblemCode> {
        self.code.parse().ok()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error that retrying cannot fix, or the last of the
    /// attempts answered a retryable one.
    #[error("{} {}: {}", .0.status, .0.code, .0.detail)]
    Problem(Problem),
    /// No answer: connection refused, reset or dropped, or an attempt timed out. The
    /// operation may or may not have been processed; retrying with the same key is safe.
    #[error("no answer from the server{}: {source}", if *.timed_out { " in time" } else { "" })]
    Transport {
        timed_out: bool,
        #[source]
        source: reqwest::Error,
    },
    /// The TLS handshake refused the server's certificate: it does not verify (unknown
    /// issuer, another host name, expired). Nothing of the request was sent; a retry would
    /// meet the same certificate, so there is none.
    #[error("the server's TLS certificate was refused; nothing was sent: {source}")]
    Tls {
        #[source]
        source: reqwest::Error,
    },
    /// The operation's deadline came before an answer, or would have before the next attempt:
    /// `server_wait` is the server's `Retry-After` when that wait is what runs past it; `last`
    /// is the last attempt's failure.
    #[error("{}", deadline_text(*.deadline, *.attempts, *.server_wait, last))]
    DeadlineExceeded {
        deadline: Duration,
        attempts: u32,
        server_wait: Option<Duration>,
        #[source]
        last: Box<ClientError>,
    },
    /// The retry budget had no token for this retry before the deadline: the server is
    /// failing many requests, and this client stops adding load.
    #[error("retry budget exhausted after {attempts} attempt(s); last failure: {last}")]
    BudgetExhausted {
        attempts: u32,
        #[source]
        last: Box<ClientError>,
    },
    /// A success answer whose body is not what docs/api.md promises (or none whole): the
    /// operation was done, or a proxy answered for the server; its outcome is unknown.
    #[error("unexpected answer body (status {status}): {source}")]
    InvalidResponse {
        status: u16,
        #[source]
        source: serde_json::Error,
    },
    /// An attempt's outcome is unknown (`earlier`: its failure, or the last attempt itself
    /// when a first answer to an operation was not oncepay's own), and the last attempt ended
    /// with an answer that does not tell it: not oncepay's own (a proxy's 4xx page or
    /// redirect, which may come after the proxy passed the request on), or no answer at all (a
    /// certificate refused on a new connection). The operation may have been done: resume it
    /// with the same key.
    #[error(
        "the outcome is unknown ({earlier}), and the last of {attempts} attempt(s) was not answered by oncepay: {last}"
    )]
    Unresolved {
        attempts: u32,
        earlier: String,
        #[source]
        last: Box<ClientError>,
    },
    /// A caller's value the client refuses before sending anything.
    #[error("{0}")]
    InvalidArgument(String),
}

impl ClientError {
    /// The machine-readable code: the problem's `code`, or one naming the local failure.
    pub fn code(&self) -> &str {
        match self {
            Self::Problem(problem) => &problem.code,
            Self::Transport { timed_out: true, .. } => "timeout",
            Self::Transport { timed_out: false, .. } => "transport_error",
            Self::Tls { .. } => "tls_certificate_refused",
            Self::DeadlineExceeded { .. } => "deadline_exceeded",
            Self::BudgetExhausted { .. } => "retry_budget_exhausted",
            Self::InvalidResponse { .. } => "invalid_response",
            Self::Unresolved { .. } => "outcome_unknown",
            Self::InvalidArgument(_) => "invalid_argument",
        }
    }

    /// The HTTP status of a problem answer.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Problem(problem) => Some(problem.status),
            _ => None,
        }
    }

    /// Whether this answer tells what the operation's key did: oncepay's answer once the key
    /// was looked at (a replay, a decline stored with the key, the key refused as reused or
    /// expired). An answer given before the key is looked at (authentication, the body's form
    /// or size, a route, a processor not configured) says nothing of an earlier attempt with
    /// the key: an API key revoked between two attempts, or a new build refusing what an old
    /// one took, answers so even when the first attempt paid.
    pub(crate) fn speaks_for_the_key(&self) -> bool {
        use crate::protocol::ProblemCode as C;
        let Self::Problem(problem) = self else {
            return false;
        };
        problem.from_oncepay
            && (problem.replayed
                || matches!(
                    problem.oncepay_code(),
                    Some(
                        C::InsufficientFunds
                            | C::CardDeclined
                            | C::RefundFailed
                            | C::InvalidPaymentMethod
                            | C::AccountNotFound
                            | C::AccountExists
                            | C::AlreadyRefunded
                            | C::TooManyEndpoints
                            | C::IdempotencyKeyReused
                            | C::IdempotencyKeyExpired
                    )
                ))
    }

    /// Whether this is an answer that did not come from oncepay (a proxy's or gateway's page,
    /// a redirect): it says nothing of what oncepay did.
    pub(crate) fn answered_in_oncepays_place(&self) -> bool {
        match self {
            Self::Problem(problem) => !problem.from_oncepay,
            Self::Unresolved { last, .. } => last.answered_in_oncepays_place(),
            _ => false,
        }
    }

    /// Whether no attempt sent the request: each failed before it could be (the connection
    /// refused or not made, a TLS handshake that failed), so the operation was not done. Only
    /// when certain: a connection closed after the request was written is no such failure.
    /// The outcome is still "unknown" to [`ClientError::outcome_unknown`]'s callers, who retry
    /// later with the same key, which stays safe.
    pub fn nothing_sent(&self) -> bool {
        match self {
            Self::Transport { source, .. } => source.is_connect(),
            Self::Tls { .. } | Self::InvalidArgument(_) => true,
            Self::DeadlineExceeded { last, .. } | Self::BudgetExhausted { last, .. } => last.nothing_sent(),
            _ => false,
        }
    }

    /// Whether the operation may have been processed although this error was returned: then
    /// the caller should send it again later *with the same key*, never with a new one.
    pub fn outcome_unknown(&self) -> bool {
        match self {
            Self::Problem(problem) => crate::policy::retryable(problem.status, problem.oncepay_code()),
            Self::Transport { .. }
            | Self::DeadlineExceeded { .. }
            | Self::BudgetExhausted { .. }
            | Self::Unresolved { .. } => true,
            Self::InvalidResponse { status, .. } => (200..300).contains(status),
            Self::Tls { .. } | Self::InvalidArgument(_) => false,
        }
    }
}

/// [`ClientError::DeadlineExceeded`]'s words: "exceeded" only when the time did run out.
/// Who asked for the wait is named (found from outside: a proxy's 503 page was "the server"),
/// and a wait beyond any deadline is not printed to the nanosecond (`Retry-After:
/// 99999999999999999999` read `18446744073709551615.999999999s`).
fn deadline_text(deadline: Duration, attempts: u32, server_wait: Option<Duration>, last: &ClientError) -> String {
    match server_wait {
        Some(wait) => format!(
            "{} asked to wait {} before the next attempt, past the deadline of {deadline:?}; stopped after {attempts} attempt(s); last failure: {last}",
            if last.answered_in_oncepays_place() {
                "an answer that did not come from oncepay"
            } else {
                "the server"
            },
            if wait >= Duration::from_secs(366 * 24 * 3600) {
                "more than a year".to_owned()
            } else {
                format!("{wait:?}")
            }
        ),
        None => format!("deadline of {deadline:?} exceeded after {attempts} attempt(s); last failure: {last}"),
    }
}
