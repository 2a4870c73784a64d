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

use actix_web::{web, HttpResponse};

use crate::error::ApiError;

pub use openapi::document as openapi_document;

/// The operations listener's routes (`ONCEPAY_METRICS_BIND`).
pub use health::configure_operations;

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
