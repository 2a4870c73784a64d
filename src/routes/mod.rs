//! The HTTP edge: each resource module registers its own routes.

mod accounts;
mod admin;
mod health;
mod intake;
mod openapi;
mod payments;
pub mod schemas;

use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse, HttpResponseBuilder};
use serde::Serialize;

use crate::error::{ApiError, REPLAYED_HEADER};
use crate::ledger::{Outcome, Refusal, Reply};
use crate::telemetry::RequestOutcome;

pub fn configure(cfg: &mut web::ServiceConfig) {
    payments::configure(cfg);
    accounts::configure(cfg);
    admin::configure(cfg);
    health::configure(cfg);
    openapi::configure(cfg);
    // Unknown routes and methods answer problem+json, not actix's empty 404/405.
    cfg.default_service(web::to(|| async { Err::<HttpResponse, _>(ApiError::NotFound) }));
}

pub use openapi::document as openapi_document;

impl From<Refusal> for ApiError {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Declined { decline, replayed } => ApiError::Declined { decline, replayed },
            Refusal::KeyReused => ApiError::KeyReused,
            Refusal::KeyExpired => ApiError::KeyExpired,
        }
    }
}

/// Answers an operation's outcome: `status` and `body` for a success, marked as a replay
/// when it is one; `keyed` tells a keyless (`allow`) request apart in logs and metrics.
fn respond<T, B: Serialize>(
    outcome: Outcome<T>,
    keyed: bool,
    status: StatusCode,
    build: impl FnOnce(T, &mut HttpResponseBuilder) -> B,
) -> Result<HttpResponse, ApiError> {
    let (resource, replayed) = match outcome? {
        Reply::New(resource) => (resource, false),
        Reply::Replayed(resource) => (resource, true),
    };
    let mut response = HttpResponse::build(status);
    if keyed {
        response.insert_header((REPLAYED_HEADER, if replayed { "true" } else { "false" }));
    }
    let body = build(resource, &mut response);
    let mut response = response.json(body);
    let label = match (replayed, keyed) {
        (true, _) => "replayed",
        (false, true) => "created",
        (false, false) => "keyless",
    };
    response.extensions_mut().insert(RequestOutcome(label));
    Ok(response)
}
