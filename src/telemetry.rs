//! Logs: one structured line per request; JSON with `ONCEPAY_LOG_FORMAT=json`. API keys and
//! bodies are never logged.

use std::time::Instant;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{web, HttpMessage};
use tracing::Instrument as _;
use tracing_subscriber::EnvFilter;

use crate::error::ApiError;
use crate::state::AppState;
use crate::tenants::Tenant;

/// The outcome of a successful request (errors carry theirs), for logs and metrics.
#[derive(Clone, Copy, Debug)]
pub struct RequestOutcome(pub &'static str);

/// Marks a request processed without a key under policy `allow`, whatever its answer: a
/// decline (402, 404, 409) was processed unprotected too, and is logged as such.
#[derive(Clone, Copy, Debug)]
pub struct Keyless;

pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// actix-http's dispatcher logs every malformed request head at ERROR (`stream error: request
/// parse error: ...`): any client could write ERROR lines at will, and alerts on ERROR would
/// page on it. Its answers are the problems of docs/api.md ("framing"); its lines are off
/// unless `RUST_LOG` names `actix_http` itself.
const QUIET_DISPATCHER: &str = "actix_http::h1::dispatcher=off";

/// Installs the global subscriber. `RUST_LOG` filters (default `info`); logs go to stderr.
pub fn init(json: bool) {
    let asked = std::env::var("RUST_LOG").unwrap_or_default();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let filter = if asked.contains("actix_http") {
        filter
    } else {
        filter.add_directive(QUIET_DISPATCHER.parse().expect("a valid directive"))
    };
    // Colours only for a person at a terminal: in a file or a pipe the escape codes broke
    // every `grep 'outcome="key_reused"'` of the runbooks and were 38 % of the bytes (found
    // by a soak writing its logs to files). `NO_COLOR` turns them off at a terminal too.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().flatten_event(true).try_init()
    } else {
        builder.try_init()
    };
}

/// Middleware: request id, one log line and the metrics of every request.
pub async fn request_log(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let started = Instant::now();
    let request_id = req
        .headers()
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(|| uuid::Uuid::new_v4().simple().to_string(), str::to_owned);
    let state = req.app_data::<web::Data<AppState>>().cloned();
    let method = req.method().clone();
    // What the request logs on its way (a database failure's line) carries its request id.
    let mut res = next
        .call(req)
        .instrument(tracing::info_span!("request", request_id = %request_id))
        .await?;

    let elapsed = started.elapsed();
    let route = res.request().match_pattern().unwrap_or_else(|| "unmatched".to_owned());
    let status = res.status().as_u16();
    let error = res.response().error().and_then(|e| e.as_error::<ApiError>());
    let code = error.map(ApiError::code);
    let outcome = error
        .map(ApiError::outcome)
        .or_else(|| res.response().extensions().get::<RequestOutcome>().map(|o| o.0))
        .unwrap_or(if status < 400 { "ok" } else { "error" });
    let tenant = res.request().extensions().get::<Tenant>().map(|t| t.id.to_string());
    if let Some(state) = state {
        state.metrics.requests.with_label_values(&[&route, outcome]).inc();
        state
            .metrics
            .duration
            .with_label_values(&[&route])
            .observe(elapsed.as_secs_f64());
        // Error answers to clients: a load balancer's probe answered 503 while the database
        // is away is not one (it would page on its own: ops/prometheus/rules.yml), nor is a
        // top-up's 503 while its cardholder does 3-D Secure (`waiting`), which
        // `OncepayUnavailable` would page on as an outage.
        let probe = matches!(route.as_str(), "/healthz" | "/readyz" | "/metrics");
        if let (Some(code), false) = (code, probe || outcome == "waiting") {
            state.metrics.errors.with_label_values(&[code.as_str()]).inc();
        }
        if let Some(tenant) = &tenant {
            match outcome {
                "replayed" => state.metrics.replays_by_tenant.with_label_values(&[tenant]).inc(),
                "key_reused" => state.metrics.key_reused_by_tenant.with_label_values(&[tenant]).inc(),
                _ => {}
            }
            // Any answer but a transient failure (nothing processed, the client retries).
            if res.request().extensions().contains::<Keyless>() && status < 500 {
                state.metrics.keyless_by_tenant.with_label_values(&[tenant]).inc();
            }
        }
    }
    tracing::info!(
        request_id = %request_id,
        tenant = tenant.as_deref().unwrap_or("-"),
        method = %method,
        route = %route,
        status,
        outcome,
        replayed = outcome == "replayed",
        latency_ms = elapsed.as_secs_f64() * 1000.0,
        "request"
    );
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        res.headers_mut()
            .insert(HeaderName::from_static(REQUEST_ID_HEADER), value);
    }
    Ok(res)
}
