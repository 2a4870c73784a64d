//! The HTTP edge: each resource module registers its own routes; every idempotent operation
//! goes through the one pipeline (`pipeline`).

mod accounts;
mod admin;
mod health;
mod intake;
mod keys;
mod lists;
mod openapi;
mod payments;
mod pipeline;
mod recovery;
pub mod schemas;
mod top_ups;
mod transfers;
mod webhooks;

use actix_web::{guard, web, HttpResponse};

use crate::error::ApiError;

pub use openapi::document as openapi_document;

/// The operations listener's routes (`ONCEPAY_METRICS_BIND`).
pub use health::configure_operations;

/// A route for `GET` and `HEAD`: a server answering GET answers HEAD alike, without the
/// content (RFC 9110, 9.3.2; actix-http writes no body to a HEAD). Found from outside: a load
/// balancer's HEAD health check got 404 from `/healthz` and `/readyz`.
fn get() -> actix_web::Route {
    web::route().guard(guard::Any(guard::Get()).or(guard::Head()))
}

pub fn configure(cfg: &mut web::ServiceConfig) {
    payments::configure(cfg);
    accounts::configure(cfg);
    transfers::configure(cfg);
    top_ups::configure(cfg);
    webhooks::configure(cfg);
    recovery::configure(cfg);
    keys::configure(cfg);
    admin::configure(cfg);
    health::configure(cfg);
    openapi::configure(cfg);
    // Unknown routes and methods answer problem+json, not actix's empty 404/405.
    cfg.default_service(web::to(|| async { Err::<HttpResponse, _>(ApiError::NotFound) }));
}
