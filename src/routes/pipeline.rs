//! The one pipeline of every idempotent operation (see `crate::idempotency` for the
//! protocol): intake (authentication, body size and type, the key, the body), claim and
//! effect (one SQL call), respond. [`intake`] and [`answer`] are also the card top-ups'
//! (`super::top_ups`), whose effect is not one SQL call. An operation plugs in as an [`Endpoint`]: its body and
//! answer types, how it builds its effect, how it renders the row it gets back. Everything
//! else (method, path, statuses, declines) comes from its entry in `crate::operation`.

use std::future::Future;

use actix_web::http::{header, StatusCode};
use actix_web::web::Bytes;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::de::DeserializeOwned;
use serde::Serialize;
use utoipa::ToSchema;

use super::intake::{no_query, parse_body, read_body, EmptyBody};
use crate::db::DbError;
use crate::domain::TenantId;
use crate::error::{ApiError, REPLAYED_HEADER};
use crate::idempotency::cache::{Finished, Lookup};
use crate::idempotency::{self, Claim, IdempotencyKey};
use crate::ledger::{ClaimArgs, Effect, Outcome, Refusal, Reply};
use crate::operation::Spec;
use crate::state::{AppState, CachedAnswer};
use crate::telemetry::RequestOutcome;
use crate::tenants::Tenant;
use crate::throttle::Throttle;

/// An operation as the HTTP edge sees it.
pub trait Endpoint: 'static {
    type Effect: Effect;
    /// The request body, exactly as documented (deserialised after the strict JSON parse).
    type In: DeserializeOwned + ToSchema;
    /// The answer's body.
    type Out: Serialize + ToSchema;
    /// Whether an empty body means `{}`.
    const EMPTY_BODY: EmptyBody = EmptyBody::Refused;
    /// Whether this process's replay cache may answer the operation's replays. Not when a
    /// replay's answer depends on what happened since (an endpoint's secret, rotated): every
    /// replica must answer such a replay alike, from the database.
    const CACHES_REPLAYS: bool = true;

    /// Builds the effect from the path and the body, and gives the value of the canonical
    /// path's `{id}`, if it has one.
    fn effect(req: &HttpRequest, body: Self::In) -> Result<(Self::Effect, Option<String>), ApiError>;

    /// Checks the effect against the world outside the request before anything is claimed
    /// (a webhook URL's addresses): a refusal is a 400 like the body's own.
    fn verify(_req: &HttpRequest, _effect: &Self::Effect) -> impl Future<Output = Result<(), ApiError>> {
        std::future::ready(Ok(()))
    }

    /// The canonical path with its parameters filled in (the fingerprint's, and the key
    /// row's): by default the `{id}` that [`Endpoint::effect`] gave. A path with a second
    /// parameter fills it from the effect.
    fn path(spec: &Spec, id: Option<String>, _effect: &Self::Effect) -> String {
        id.map_or_else(|| spec.path.to_owned(), |id| spec.path_with(&id))
    }

    /// Rebuilds the answer from the row the SQL function returned.
    fn render(row: <Self::Effect as Effect>::Row) -> Result<Self::Out, ApiError>;

    /// Runs the effect: by default in a statement of its own.
    fn execute(
        state: &AppState,
        tenant: TenantId,
        claim: ClaimArgs,
        effect: Self::Effect,
    ) -> impl Future<Output = Result<Outcome<<Self::Effect as Effect>::Row>, DbError>> {
        async move { state.run_alone(tenant, &claim, &effect).await }
    }

    /// The `Location` of the created resource, if the operation creates one.
    fn location(_out: &Self::Out) -> Option<String> {
        None
    }
}

pub fn spec<E: Endpoint>() -> &'static Spec {
    <E::Effect as Effect>::OPERATION.spec()
}

/// Registers the operation's canonical path and its aliases.
pub fn route<E: Endpoint>(cfg: &mut web::ServiceConfig) {
    let spec = spec::<E>();
    for path in std::iter::once(&spec.path).chain(spec.aliases) {
        cfg.route(
            path,
            web::method(spec.method.parse().expect("a valid method")).to(handle::<E>),
        );
    }
}

/// What the intake of an idempotent operation gives: the tenant, the request shaped into
/// what the operation runs (its effect), the client's or the derived key (`None`: a keyless
/// request under policy `allow`), and the claim's arguments for the SQL function.
pub struct Intake<S> {
    pub tenant: Tenant,
    pub input: S,
    pub claim: Option<Claim>,
    pub args: ClaimArgs,
}

/// The intake of every operation that takes an `Idempotency-Key`, in one order:
/// authentication (401), the body within its size and time (413, 408, 415), the key (400)
/// or the tenant's policy for a keyless request, the strict parse into `T` (400), then
/// `shape`, which turns `T` into what the operation runs and gives the canonical path with
/// its parameters filled in (its own refusals come here, before anything is claimed), and
/// last the fingerprint of method, path and body, and the claim. Nothing is stored: the
/// claim happens in the operation's SQL.
/// The warning that keyless requests are processed unprotected: once a minute, with the
/// count since.
static KEYLESS: Throttle = Throttle::new(std::time::Duration::from_secs(60));

pub async fn intake<T: DeserializeOwned, S>(
    req: &HttpRequest,
    payload: web::Payload,
    state: &AppState,
    spec: &'static Spec,
    empty: EmptyBody,
    shape: impl AsyncFnOnce(T) -> Result<(S, String), ApiError>,
) -> Result<Intake<S>, ApiError> {
    let tenant = state.tenant(req).await?;
    let bytes = read_body(req, payload, state.settings.max_body_bytes).await?;
    let key = IdempotencyKey::from_headers(req.headers()).map_err(ApiError::InvalidIdempotencyKey)?;
    let key = idempotency::key_or_policy(key, tenant.policy)?;
    let (body, input) = parse_body::<T>(&bytes, empty)?;
    no_query(req)?;
    let (input, path) = shape(input).await?;

    let fingerprint = idempotency::fingerprint(spec.method, &path, &body);
    let claim = idempotency::claim_for(key, tenant.policy, fingerprint, state.windows());
    if claim.is_none() {
        // Each request's own line says `outcome=keyless`, and the metric counts them by
        // tenant: the warning is a reminder, not a line a request (found in a soak: 8,464
        // WARN lines an hour from one tenant migrating to keys).
        if let Some(held_back) = KEYLESS.admit(std::time::Instant::now()) {
            tracing::warn!(tenant = %tenant.id, path, keyless_since_last_line = held_back,
                "keyless requests processed without idempotency protection (policy allow); \
                 oncepay_keyless_requests_total counts them by tenant");
        }
        actix_web::HttpMessage::extensions_mut(req).insert(crate::telemetry::Keyless);
    }
    let args = ClaimArgs::new(spec, path, claim.as_ref(), state.settings.inflight_wait);
    Ok(Intake {
        tenant,
        input,
        claim,
        args,
    })
}

async fn handle<E: Endpoint>(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let spec = spec::<E>();
    let Intake {
        tenant,
        input: effect,
        claim,
        args,
    } = intake(&req, payload, &state, spec, E::EMPTY_BODY, async |input: E::In| {
        let (effect, id) = E::effect(&req, input)?;
        E::verify(&req, &effect).await?;
        let path = E::path(spec, id, &effect);
        Ok((effect, path))
    })
    .await?;
    if let Some(claim) = claim.as_ref().filter(|_| E::CACHES_REPLAYS) {
        if let Some(answer) = cached(&state, spec, &tenant, claim) {
            return answer;
        }
    }

    let outcome = E::execute(&state, tenant.id, args, effect)
        .await
        .map_err(|err| without_key(err.into(), sent_a_key(claim.as_ref())))?;
    let expires_at = outcome.expires_at;
    let (answer, finished) = respond::<E>(spec, outcome, claim.is_some())?;
    let finished = finished.filter(|_| E::CACHES_REPLAYS);
    if let (Some(claim), Some(expires_at), Some(value)) = (&claim, expires_at, finished) {
        let finished = Finished {
            fingerprint: claim.fingerprint,
            expires_at,
            value,
        };
        state.replays.insert(tenant.id, &claim.key, finished);
        state.metrics.replay_cache_entries.set(state.replays.len() as i64);
    }
    answer
}

/// Whether the client sent the request's key: `false` without a key (policy `allow`) and for
/// a key the server derived from the body (policy `fingerprint`), which protects a resend
/// for `ONCEPAY_FINGERPRINT_WINDOW_SECS` only.
pub fn sent_a_key(claim: Option<&Claim>) -> bool {
    claim.is_some_and(|c| !c.derived)
}

/// A request without a key of its client's (policy `allow`, or `fingerprint`'s derived key)
/// whose outcome is unknown, or whose top-up waits, is not told to retry with a key it has
/// not got: a second keyless request may do the operation twice (found from outside: a
/// `fingerprint` top-up waiting for 3-D Secure, told "Retry-After: 5, retry with the same
/// Idempotency-Key", was resent after its derived key's 60 s and charged the card again).
pub fn without_key(err: ApiError, keyed: bool) -> ApiError {
    match err {
        ApiError::OutcomeUnknown if !keyed => ApiError::OutcomeUnknownWithoutKey,
        ApiError::ProcessorUnknown { top_up } if !keyed => ApiError::ProcessorUnknownWithoutKey { top_up },
        ApiError::ProcessorWaiting { top_up } if !keyed => ApiError::ProcessorWaitingWithoutKey { top_up },
        other => other,
    }
}

/// The answer from this process's replay cache, if it knows the key (`None`: ask the
/// database).
fn cached(state: &AppState, spec: &Spec, tenant: &Tenant, claim: &Claim) -> Option<Result<HttpResponse, ApiError>> {
    let hit = match state.replays.lookup(tenant.id, &claim.key, &claim.fingerprint) {
        Lookup::Miss => {
            state.metrics.replay_cache_misses.inc();
            return None;
        }
        Lookup::Reused => Err(ApiError::KeyReused),
        Lookup::Replay(finished) => match &finished.value {
            CachedAnswer::Declined(decline) => Err(ApiError::Declined {
                decline: *decline,
                replayed: true,
                detail: spec.decline_detail(*decline),
            }),
            CachedAnswer::Success { status, body, location } => {
                Ok(answer(*status, body.clone(), location.as_deref(), Replay::Replayed))
            }
        },
    };
    state.metrics.replay_cache_hits.inc();
    Some(hit)
}

/// Answers an outcome: the success status and body, marked as a replay when it is one;
/// `keyed` tells a keyless (`allow`) request apart in logs and metrics. Also gives what the
/// replay cache may keep of it (a finished result: a success or a stored decline).
fn respond<E: Endpoint>(
    spec: &Spec,
    outcome: Outcome<<E::Effect as Effect>::Row>,
    keyed: bool,
) -> Result<(Result<HttpResponse, ApiError>, Option<CachedAnswer>), ApiError> {
    let (row, replayed) = match outcome.result {
        Ok(Reply::New(row)) => (row, false),
        Ok(Reply::Replayed(row)) => (row, true),
        Err(Refusal::Declined { decline, replayed }) => {
            return Ok((
                Err(ApiError::Declined {
                    decline,
                    replayed,
                    detail: spec.decline_detail(decline),
                }),
                Some(CachedAnswer::Declined(decline)),
            ))
        }
        Err(refusal) => return Ok((Err(refusal.into()), None)),
    };
    let out = E::render(row)?;
    let status = StatusCode::from_u16(spec.success_status).expect("the table holds valid statuses");
    let location = E::location(&out);
    let body = json_body(&out)?;
    let response = answer(status, body.clone(), location.as_deref(), Replay::of(keyed, replayed));
    Ok((Ok(response), Some(CachedAnswer::Success { status, body, location })))
}

/// Whether an answer repeats a stored result, as its `Idempotency-Replayed` header and the
/// request log say it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Replay {
    /// A keyless request (policy `allow`): no header, logged as `keyless`.
    Keyless,
    /// The first answer of a key: `false`, `created`.
    New,
    /// A stored result answered again: `true`, `replayed`.
    Replayed,
}

impl Replay {
    pub fn of(keyed: bool, replayed: bool) -> Self {
        match (keyed, replayed) {
            (_, true) => Replay::Replayed,
            (true, false) => Replay::New,
            (false, false) => Replay::Keyless,
        }
    }
}

/// A success of an idempotent operation, whichever path answers it (first answer, replay
/// from the database or from this process's cache, a top-up): its status, JSON body and
/// `Location`, `Idempotency-Replayed` on a keyed request, and the label of the request log.
pub fn answer(status: StatusCode, body: Bytes, location: Option<&str>, replay: Replay) -> HttpResponse {
    let mut response = HttpResponse::build(status);
    match replay {
        Replay::Keyless => {}
        Replay::New => {
            response.insert_header((REPLAYED_HEADER, "false"));
        }
        Replay::Replayed => {
            response.insert_header((REPLAYED_HEADER, "true"));
        }
    }
    if let Some(location) = location {
        response.insert_header((header::LOCATION, location));
    }
    let mut response = response.content_type(mime::APPLICATION_JSON).body(body);
    let label = match replay {
        Replay::Keyless => "keyless",
        // 202: accepted, not finished (a refund pending at the processor; a retry looks again).
        Replay::New if status == StatusCode::ACCEPTED => "pending",
        Replay::New => "created",
        Replay::Replayed => "replayed",
    };
    response.extensions_mut().insert(RequestOutcome(label));
    response
}

/// An answer's body: its fields in declaration order, as every answer.
pub fn json_body<T: Serialize>(out: &T) -> Result<Bytes, ApiError> {
    serde_json::to_vec(out)
        .map(Bytes::from)
        .map_err(|e| ApiError::Internal(e.into()))
}

impl From<Refusal> for ApiError {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Declined { decline, replayed } => ApiError::Declined {
                decline,
                replayed,
                detail: decline.detail(),
            },
            Refusal::KeyReused => ApiError::KeyReused,
            Refusal::KeyExpired => ApiError::KeyExpired,
        }
    }
}

/// A row that contradicts its operation's answer (a bug, logged once as a 500).
pub fn corrupt(what: &str) -> ApiError {
    ApiError::Internal(anyhow::anyhow!("corrupt row: {what}"))
}
