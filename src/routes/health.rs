//! `GET /healthz`, `GET /readyz`, `GET /metrics`.

use actix_web::{web, HttpResponse};

use crate::error::ApiError;
use crate::startup::AppState;

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/healthz", web::get().to(healthz))
        .route("/readyz", web::get().to(readyz))
        .route("/metrics", web::get().to(metrics));
}

async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({ "status": "ok" }))
}

/// Ready when the database answers a query.
async fn readyz(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let mut conn = state.conn().await.map_err(|_| ApiError::Unavailable)?;
    let result = sqlx::query("SELECT 1").execute(&mut *conn).await;
    conn.discard_if_broken(result).map_err(|_| ApiError::Unavailable)?;
    Ok(HttpResponse::Ok().json(serde_json::json!({ "status": "ready" })))
}

async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(state.metrics.render(&state.pool))
}
