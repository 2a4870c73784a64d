//! `GET /healthz`, `GET /readyz` (on both listeners: load balancers probe the API's) and
//! `GET /metrics` (on the operations listener only, `ONCEPAY_METRICS_BIND`: the metrics name
//! every tenant, and anyone who reaches the API port must not count them).

use actix_web::{web, HttpResponse};
use utoipa::ToSchema;

use super::schemas::Unavailable;
use crate::error::ApiError;
use crate::state::AppState;

/// The probes of the API listener.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/healthz", super::get().to(healthz))
        .route("/readyz", super::get().to(readyz));
}

/// The operations listener: the probes and the metrics; anything else is 404.
pub fn configure_operations(cfg: &mut web::ServiceConfig) {
    configure(cfg);
    cfg.route("/metrics", super::get().to(metrics));
    cfg.default_service(web::to(|| async { Err::<HttpResponse, _>(ApiError::NotFound) }));
}

#[derive(serde::Serialize, ToSchema)]
struct StatusOut {
    status: &'static str,
}

/// Liveness: 200 while the process runs.
#[utoipa::path(get, path = "/healthz", tag = "operations", operation_id = "healthz",
    responses((status = 200, description = "Alive.", body = StatusOut)))]
pub(super) async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(StatusOut { status: "ok" })
}

/// Readiness: 200 when a writable primary answers, else 503. A database that answers but is
/// a standby or read-only (as during a failover) is not ready, and the connection that
/// reached it is dropped, so the next one (through a proxy) finds the new primary. Before
/// `serve` has reached its database and checked the schema it is 503 without a query, and
/// from SIGTERM or SIGINT on, while the process drains its requests, 503 as well.
#[utoipa::path(get, path = "/readyz", tag = "operations", operation_id = "readyz",
    responses(
        (status = 200, description = "Ready.", body = StatusOut),
        (status = 503, response = Unavailable),
    ))]
pub(super) async fn readyz(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    state.check_ready()?;
    if state.ready.is_stopping() {
        return Err(ApiError::Stopping);
    }
    // Bounded: a database that holds the query without answering (PgBouncer's PAUSE, a
    // partition) kept the probe open until it answered (found from outside: 200 after 8 s of
    // a PAUSE, and no answer to 1 s probes for 20 s), where a probe wants 503 now.
    let writable = tokio::time::timeout(crate::db::PROBE_WITHIN, async {
        crate::db::writable(&mut state.conn().await?).await
    })
    .await;
    match writable {
        Ok(Ok(true)) => Ok(HttpResponse::Ok().json(StatusOut { status: "ready" })),
        _ => Err(ApiError::Unavailable),
    }
}

/// Prometheus metrics (text exposition format), on the operations listener.
pub(super) async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(
            state
                .metrics
                .render(
                    &state.db,
                    state.lists.status(),
                    state.settings.retention,
                    state.is_ready() && !state.ready.is_stopping(),
                )
                .await,
        )
}
