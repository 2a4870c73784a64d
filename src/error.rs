//! The one error type of the HTTP API, rendered as `application/problem+json` (RFC 9457)
//! with a machine-readable `code` (docs/api.md, Errors).

use actix_web::http::{header, StatusCode};
use actix_web::{HttpResponse, ResponseError};
use oncepay_protocol::routes;
use serde::Serialize;

use crate::db::DbError;
use crate::domain::TopUpId;
use crate::operation::Decline;
use crate::throttle::Throttle;

pub use oncepay_protocol::ProblemCode;

/// Seconds a client is told to wait (`Retry-After`) on 409 in progress, 429 and 503.
pub const RETRY_AFTER_SECS: u64 = 1;
/// The `Retry-After` of a top-up that waits at the processor, and of a refund of one.
pub const TOP_UP_PROCESSING_RETRY_AFTER_SECS: u64 = 5;

/// Header marking a replayed answer.
pub use oncepay_protocol::REPLAYED_HEADER;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("a valid API key is required: send `Authorization: Bearer <api_key>`")]
    Unauthorized,
    /// An admin call without the admin token (401 `unauthorized`, like a tenant call without
    /// its key, but saying which bearer is wanted).
    #[error("the admin token is required: send `Authorization: Bearer <ONCEPAY_ADMIN_TOKEN>`")]
    AdminUnauthorized,
    #[error("the admin API is disabled: set ONCEPAY_ADMIN_TOKEN to enable it")]
    AdminDisabled,
    #[error("the body exceeds the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("the body did not arrive within {secs} seconds; nothing was processed")]
    BodyTimeout { secs: u64 },
    #[error("{0}")]
    UnsupportedMediaType(&'static str),
    #[error("this tenant requires an `Idempotency-Key` header on every POST")]
    MissingIdempotencyKey,
    #[error("invalid Idempotency-Key: {0}")]
    InvalidIdempotencyKey(&'static str),
    #[error("the body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("{0}")]
    InvalidRequest(String),
    #[error("no such resource")]
    NotFound,
    /// A read of an account that does not exist (a payment from one is a stored decline).
    #[error("no such account")]
    AccountNotFound,
    /// A deterministic failure of the operation: stored with the key and replayed.
    /// `detail` is the decline's own (`Decline::detail`) or the operation's words for it
    /// (`Spec::decline_detail`).
    #[error("{detail}")]
    Declined {
        decline: Decline,
        replayed: bool,
        detail: &'static str,
    },
    /// A top-up's stored decline, decided by the card processor (with its `decline_code`);
    /// `detail` as `Declined`'s.
    #[error("{detail}")]
    ProcessorDeclined {
        decline: Decline,
        decline_code: Option<String>,
        replayed: bool,
        detail: &'static str,
    },
    #[error("top-ups need a card processor: the operator has not set ONCEPAY_PROCESSOR_URL")]
    ProcessorNotConfigured,
    /// Its `Location` names the top-up, as a waiting one's does.
    #[error("the card processor's outcome is not known yet (it did not answer, or its answer decided nothing); retry with the same Idempotency-Key: the retry resumes this operation, never charges twice, and answers its final result")]
    ProcessorUnknown { top_up: TopUpId },
    /// [`ApiError::ProcessorUnknown`] to a request without a key of its client's: the top-up
    /// exists and the completer ends it; sent again, the request may be a second charge.
    #[error("the card processor's outcome for top-up {top_up} is not known yet (it did not answer, or its answer decided nothing); GET /top-ups/{top_up} shows how it ends (oncepay finishes it on its own). This request carried no Idempotency-Key: do not send it again, which may charge twice")]
    ProcessorUnknownWithoutKey { top_up: TopUpId },
    /// A top-up whose PaymentIntent waits at the processor (`requires_action`, `processing`):
    /// its end may take minutes, not the second a lost answer takes to look up. Its
    /// `Location` names the top-up, as a 201's would.
    #[error("the card processor has not finished the charge: it waits (GET /top-ups/{top_up}: processor_status, e.g. requires_action for the cardholder's action, at most ONCEPAY_TOPUP_ACTION_TIMEOUT_SECS); retry with the same Idempotency-Key: the retry answers its final result once there is one, and never charges twice")]
    ProcessorWaiting { top_up: TopUpId },
    /// [`ApiError::ProcessorWaiting`] to a keyless request (policy `allow`): the top-up exists
    /// and the completer ends it; sent again, the request would be a second top-up.
    #[error("the card processor has not finished the charge of top-up {top_up}: it waits (GET /top-ups/{top_up} shows how it ends: processor_status, e.g. requires_action for the cardholder's action, at most ONCEPAY_TOPUP_ACTION_TIMEOUT_SECS). This request carried no Idempotency-Key: do not send it again, which would be a second top-up")]
    ProcessorWaitingWithoutKey { top_up: TopUpId },
    #[error("this Idempotency-Key was already used with a different request (another body, path or method); use a new key for a new operation")]
    KeyReused,
    #[error("this Idempotency-Key has passed its replay window; if you mean a new operation, send the request again with a new key")]
    KeyExpired,
    #[error("another request with this Idempotency-Key is still being processed; retry after the Retry-After delay: the retry answers its result (under the tenant's `fingerprint` policy, a request sent without a key has the key of its body)")]
    InProgress,
    /// `GET /idempotency-keys/{key}` while a request with the key runs: its row is not
    /// committed yet, and the key is not "never used".
    #[error("a request with this Idempotency-Key is being processed now; look again after the Retry-After delay (the request's own retry with the key waits for it and answers its result). Do not take it for unused")]
    KeyInFlight,
    /// A refund of a top-up that is still `processing`: nothing was claimed or stored, so a
    /// retry with the same key refunds it once it has succeeded.
    #[error("the top-up is still processing at the card processor (GET /top-ups/{{id}} shows when it ends: a wait for the cardholder's action may last ONCEPAY_TOPUP_ACTION_TIMEOUT_SECS); it can be refunded once it has succeeded: a retry then refunds it. Nothing was done or stored")]
    TopUpProcessing,
    /// A refund of a top-up (under another key, or none) while a refund of it is under way at
    /// the processor: nothing was claimed or stored, so a retry answers once that refund has
    /// ended. Its words name no key: a keyless request (policy `allow`) has none (found from
    /// outside: "a retry with this Idempotency-Key" to a request without one).
    #[error("a refund of this top-up is under way at the card processor (GET /top-ups/{{id}}: refund_pending); once it ends, a retry answers 409 already_refunded if it succeeded, or refunds the top-up if it failed. Nothing was done or stored")]
    TopUpRefundPending,
    /// A resend while an attempt of the event to the endpoint is out (the key is new, or
    /// free: nothing was stored under it).
    #[error("an attempt to deliver this event to this endpoint is out now; retry with the same Idempotency-Key after the Retry-After delay and the event is sent again. Nothing was stored under this key")]
    DeliveryAttemptOut,
    #[error("the service is at capacity; retry after the Retry-After delay")]
    Overloaded,
    /// A bearer of an API key's form that this replica does not know, past the rate at which
    /// it looks such bearers up (`auth::TenantCache`): nothing was looked at.
    #[error("too many requests with API keys this server does not know; nothing was looked at: retry after the Retry-After delay (a key created in the last seconds is known within 5 s)")]
    UnknownKeysThrottled,
    /// A payment refused unrun after waiting behind an earlier one of its account that is
    /// still running: the account's row is in use, not the whole service.
    #[error("an earlier payment of this account is still running (its row is in use, as by a long transaction or a payment waiting on it); nothing was done: retry after the Retry-After delay")]
    AccountBusy,
    #[error("{}", RETRY_WITH_THE_KEY)]
    Unavailable,
    /// [`ApiError::Unavailable`] where the database call's outcome is unknown (it may have
    /// committed), not rolled back: the same answer to a keyed request; a keyless one is
    /// told [`ApiError::OutcomeUnknownWithoutKey`] instead.
    #[error("{}", RETRY_WITH_THE_KEY)]
    OutcomeUnknown,
    /// `serve` has not reached its database yet (start-up): nothing was looked at or run.
    #[error("the service is starting and has not reached its database yet; nothing was processed: retry after the Retry-After delay")]
    Starting,
    /// A keyless request (policy `allow`) whose outcome is unknown: the 503s above tell a
    /// client to retry with its key, which this one has not got, and a retry without one may
    /// do the operation twice (found from outside: two card charges for one top-up).
    #[error("the outcome is not known yet, and this request carried no Idempotency-Key: it may have been done, and sending it again may do it twice. Look first (GET /payments or GET /top-ups, newest first; the account's balance), and send an Idempotency-Key, with which a retry is always safe")]
    OutcomeUnknownWithoutKey,
    /// `serve` got SIGTERM or SIGINT and is finishing its requests: `/readyz` sends the
    /// balancer elsewhere.
    #[error(
        "the service is stopping: it finishes the requests it has and takes no new ones; retry at another replica"
    )]
    Stopping,
    #[error("internal error")]
    Internal(#[source] anyhow::Error),
}

impl ApiError {
    /// The machine-readable `code` (shared with the client); it also decides the status.
    pub fn code(&self) -> ProblemCode {
        match self {
            Self::Unauthorized | Self::AdminUnauthorized => ProblemCode::Unauthorized,
            Self::AdminDisabled => ProblemCode::AdminDisabled,
            Self::BodyTooLarge { .. } => ProblemCode::BodyTooLarge,
            Self::BodyTimeout { .. } => ProblemCode::RequestTimeout,
            Self::UnsupportedMediaType(_) => ProblemCode::UnsupportedMediaType,
            Self::MissingIdempotencyKey => ProblemCode::MissingIdempotencyKey,
            Self::InvalidIdempotencyKey(_) => ProblemCode::InvalidIdempotencyKey,
            Self::InvalidJson(_) => ProblemCode::InvalidJson,
            Self::InvalidRequest(_) => ProblemCode::InvalidRequest,
            Self::NotFound => ProblemCode::NotFound,
            Self::AccountNotFound => ProblemCode::AccountNotFound,
            Self::Declined { decline, .. } | Self::ProcessorDeclined { decline, .. } => decline.code(),
            Self::ProcessorNotConfigured => ProblemCode::ProcessorNotConfigured,
            Self::ProcessorUnknown { .. }
            | Self::ProcessorUnknownWithoutKey { .. }
            | Self::ProcessorWaiting { .. }
            | Self::ProcessorWaitingWithoutKey { .. } => ProblemCode::TemporarilyUnavailable,
            Self::KeyReused => ProblemCode::IdempotencyKeyReused,
            Self::KeyExpired => ProblemCode::IdempotencyKeyExpired,
            Self::InProgress
            | Self::KeyInFlight
            | Self::TopUpProcessing
            | Self::TopUpRefundPending
            | Self::DeliveryAttemptOut => ProblemCode::RequestInProgress,
            Self::Overloaded | Self::UnknownKeysThrottled | Self::AccountBusy => ProblemCode::Overloaded,
            Self::Unavailable
            | Self::OutcomeUnknown
            | Self::Starting
            | Self::Stopping
            | Self::OutcomeUnknownWithoutKey => ProblemCode::TemporarilyUnavailable,
            Self::Internal(_) => ProblemCode::InternalError,
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Self::Unauthorized | Self::AdminUnauthorized => "Unauthorized",
            Self::AdminDisabled => "Admin API disabled",
            Self::BodyTooLarge { .. } => "Body too large",
            Self::BodyTimeout { .. } => "Request timeout",
            Self::UnsupportedMediaType(_) => "Unsupported media type",
            Self::MissingIdempotencyKey => "Missing idempotency key",
            Self::InvalidIdempotencyKey(_) => "Invalid idempotency key",
            Self::InvalidJson(_) => "Invalid JSON",
            Self::InvalidRequest(_) => "Invalid request",
            Self::NotFound => "Not found",
            Self::AccountNotFound => "Account not found",
            Self::Declined { decline, .. } | Self::ProcessorDeclined { decline, .. } => decline.title(),
            Self::ProcessorNotConfigured => "Processor not configured",
            Self::ProcessorUnknown { .. } => "Temporarily unavailable",
            Self::ProcessorUnknownWithoutKey { .. } => "Outcome unknown",
            Self::ProcessorWaiting { .. } | Self::ProcessorWaitingWithoutKey { .. } => {
                "Top-up waiting at the processor"
            }
            Self::KeyReused => "Idempotency key reused",
            Self::KeyExpired => "Idempotency key expired",
            Self::InProgress | Self::KeyInFlight => "Request in progress",
            Self::TopUpProcessing => "Top-up still processing",
            Self::TopUpRefundPending => "Refund under way",
            Self::DeliveryAttemptOut => "Delivery attempt in progress",
            Self::Overloaded | Self::UnknownKeysThrottled => "Overloaded",
            Self::AccountBusy => "Account busy",
            Self::Unavailable | Self::OutcomeUnknown | Self::Starting | Self::Stopping => "Temporarily unavailable",
            Self::OutcomeUnknownWithoutKey => "Outcome unknown",
            Self::Internal(_) => "Internal error",
        }
    }

    /// The outcome label of this error in logs and metrics (docs/operations.md, Metrics).
    pub fn outcome(&self) -> &'static str {
        match self {
            Self::Unauthorized | Self::AdminUnauthorized | Self::AdminDisabled => "unauthorized",
            Self::MissingIdempotencyKey => "missing_key",
            Self::Declined { replayed: true, .. } | Self::ProcessorDeclined { replayed: true, .. } => "replayed",
            // Contract 6b: a refund (or resend) of an unknown resource is `not_found`, though
            // stored with its key like any decline.
            Self::Declined {
                decline: Decline::NotFound,
                replayed: false,
                ..
            } => "not_found",
            Self::Declined { replayed: false, .. } | Self::ProcessorDeclined { replayed: false, .. } => "declined",
            Self::ProcessorNotConfigured => "invalid",
            Self::ProcessorUnknown { .. } | Self::ProcessorUnknownWithoutKey { .. } => "transient_error",
            // A cardholder's 3-D Secure is not an outage: counted apart from the 503s of one.
            Self::ProcessorWaiting { .. } | Self::ProcessorWaitingWithoutKey { .. } => "waiting",
            Self::KeyReused => "key_reused",
            Self::KeyExpired => "expired",
            Self::InProgress
            | Self::KeyInFlight
            | Self::TopUpProcessing
            | Self::TopUpRefundPending
            | Self::DeliveryAttemptOut => "in_progress",
            Self::Overloaded
            | Self::UnknownKeysThrottled
            | Self::AccountBusy
            | Self::Unavailable
            | Self::OutcomeUnknown
            | Self::Starting
            | Self::Stopping
            | Self::OutcomeUnknownWithoutKey => "transient_error",
            Self::NotFound | Self::AccountNotFound => "not_found",
            Self::Internal(_) => "internal_error",
            Self::BodyTooLarge { .. }
            | Self::BodyTimeout { .. }
            | Self::UnsupportedMediaType(_)
            | Self::InvalidIdempotencyKey(_)
            | Self::InvalidJson(_)
            | Self::InvalidRequest(_) => "invalid",
        }
    }

    /// The `Retry-After` of this answer, in seconds, if it has one.
    fn retry_after(&self) -> Option<u64> {
        match self {
            Self::InProgress
            | Self::KeyInFlight
            | Self::DeliveryAttemptOut
            | Self::Overloaded
            | Self::UnknownKeysThrottled
            | Self::AccountBusy
            | Self::Unavailable
            | Self::OutcomeUnknown
            | Self::Starting
            | Self::Stopping
            | Self::ProcessorUnknown { .. } => Some(RETRY_AFTER_SECS),
            // A top-up ends when the completer or a cardholder's action ends it: seconds to
            // minutes, not the one second a request in flight takes.
            Self::TopUpProcessing | Self::TopUpRefundPending | Self::ProcessorWaiting { .. } => {
                Some(TOP_UP_PROCESSING_RETRY_AFTER_SECS)
            }
            _ => None,
        }
    }
}

#[derive(Serialize)]
struct Problem<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'a str,
    status: u16,
    detail: String,
    code: &'a str,
    /// A card decline's reason, as the processor gave it.
    #[serde(skip_serializing_if = "Option::is_none")]
    decline_code: Option<&'a str>,
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.code().status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn error_response(&self) -> HttpResponse {
        if let Self::Internal(cause) = self {
            // Logged once here with its cause chain; the client gets an opaque answer.
            tracing::error!(error = format!("{cause:#}"), "internal error");
        }
        let status = self.status_code();
        let code = self.code();
        let mut response = HttpResponse::build(status);
        response.insert_header((header::CONTENT_TYPE, "application/problem+json"));
        if let Some(secs) = self.retry_after() {
            response.insert_header((header::RETRY_AFTER, secs.to_string()));
        }
        if let Self::ProcessorWaiting { top_up }
        | Self::ProcessorWaitingWithoutKey { top_up }
        | Self::ProcessorUnknown { top_up }
        | Self::ProcessorUnknownWithoutKey { top_up } = self
        {
            response.insert_header((header::LOCATION, routes::GET_TOP_UP.with_id(&top_up.to_string())));
        }
        if let Self::BodyTimeout { .. } = self {
            // The rest of a trickled body is not worth waiting for: free the connection.
            response.force_close();
        }
        if let Self::Declined { replayed: true, .. } | Self::ProcessorDeclined { replayed: true, .. } = self {
            response.insert_header((REPLAYED_HEADER, "true"));
        }
        let decline_code = match self {
            Self::ProcessorDeclined { decline_code, .. } => decline_code.as_deref(),
            _ => None,
        };
        response.json(Problem {
            kind: format!("https://oncepay.dev/problems/{code}"),
            title: self.title(),
            status: status.as_u16(),
            detail: self.to_string(),
            code: code.as_str(),
            decline_code,
        })
    }
}

/// The warning of a transient database failure: once every 10 s with the count since, not
/// once a request (each request's own line says 503 already).
static TRANSIENT: Throttle = Throttle::new(std::time::Duration::from_secs(10));

/// What a 503 after a temporary failure tells a client, whether the call was rolled back
/// ([`ApiError::Unavailable`]) or its outcome is unknown ([`ApiError::OutcomeUnknown`]).
const RETRY_WITH_THE_KEY: &str = "a temporary failure interrupted the request; retry with the same Idempotency-Key: if it was committed the retry replays it, otherwise the retry processes it";

/// The edge decides what each class of database failure means to a client.
impl From<DbError> for ApiError {
    fn from(err: DbError) -> Self {
        match err {
            DbError::InProgress => Self::InProgress,
            DbError::AttemptOut => Self::DeliveryAttemptOut,
            DbError::Saturated => Self::Overloaded,
            DbError::AccountBusy => Self::AccountBusy,
            DbError::Transient(err) => {
                match TRANSIENT.admit(std::time::Instant::now()) {
                    Some(held_back) => tracing::warn!(error = %err, failures_since_last_line = held_back,
                        "transient database failure, nothing committed"),
                    None => tracing::debug!(error = %err, "transient database failure, nothing committed"),
                }
                Self::Unavailable
            }
            DbError::Unknown(err) => {
                tracing::error!(
                    error = %err,
                    "database outcome unknown: the call may have committed; a retry with its key replays it"
                );
                Self::OutcomeUnknown
            }
            DbError::Other(err) => Self::Internal(err.into()),
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(err: sqlx::Error) -> Self {
        DbError::from(err).into()
    }
}

impl From<crate::idempotency::MissingKey> for ApiError {
    fn from(_: crate::idempotency::MissingKey) -> Self {
        Self::MissingIdempotencyKey
    }
}
