//! The OpenAPI document of the whole API, generated from the handlers' annotations and
//! served at `GET /openapi.json`. `oncepay openapi` prints it; `docs/openapi.json` is the
//! committed copy (a test fails when they differ: regenerate with `make openapi`).

use std::sync::LazyLock;

use actix_web::{web, HttpResponse};
use utoipa::openapi::path::HttpMethod;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::{RefOr, Required};
use utoipa::{Modify, OpenApi};

use super::schemas::{
    AdminDisabled, BadRequest, BodyTooLarge, Conflict, InsufficientFunds, KeyRefused, NotFound, Overloaded, Problem,
    RequestTimeout, Unauthorized, Unavailable, UnsupportedMediaType,
};
use super::{accounts, admin, health, payments};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "oncepay",
        description = "A payment API whose retried requests never charge twice. Every tenant POST takes an \
            `Idempotency-Key`; every error is `application/problem+json` with a machine-readable `code`.",
        license(name = "MIT", identifier = "MIT"),
    ),
    paths(
        payments::create, payments::show, payments::refund,
        accounts::create, accounts::show, accounts::deposit,
        admin::create_tenant, admin::update_tenant, admin::run_purge,
        health::healthz, health::readyz, health::metrics, openapi_json,
    ),
    components(
        schemas(Problem),
        responses(
            BadRequest, Unauthorized, InsufficientFunds, AdminDisabled, NotFound, Conflict, RequestTimeout, BodyTooLarge,
            UnsupportedMediaType, KeyRefused, Overloaded, Unavailable,
        ),
    ),
    modifiers(&BearerSchemes, &PayAlias, &OptionalBodies),
    tags(
        (name = "payments", description = "Charges and refunds."),
        (name = "accounts", description = "Accounts and deposits."),
        (name = "admin", description = "Operators: `Authorization: Bearer <ONCEPAY_ADMIN_TOKEN>`."),
        (name = "operations", description = "Probes, metrics and this document."),
    )
)]
struct ApiDoc;

/// The two bearer tokens: a tenant's API key and the operators' admin token.
struct BearerSchemes;

impl Modify for BearerSchemes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        let bearer = |description: &str| {
            let mut http = Http::new(HttpAuthScheme::Bearer);
            http.description = Some(description.to_owned());
            SecurityScheme::Http(http)
        };
        components.add_security_scheme(
            "api_key",
            bearer("A tenant's API key (`opk_...`), shown once at its creation. Missing or unknown: 401."),
        );
        components.add_security_scheme(
            "admin_token",
            bearer("ONCEPAY_ADMIN_TOKEN. Unset: every admin call answers 403; wrong or missing: 401."),
        );
    }
}

/// `POST /pay` is routed to the same handler as `POST /payments`: document it as the same
/// operation under its own id.
struct PayAlias;

impl Modify for PayAlias {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let mut operation = openapi
            .paths
            .get_path_operation("/payments", HttpMethod::Post)
            .expect("POST /payments is documented")
            .clone();
        operation.operation_id = Some("pay".to_owned());
        operation.summary = Some("Alias of `POST /payments` (same operation, same fingerprint path).".to_owned());
        openapi
            .paths
            .add_path_operation("/pay", vec![HttpMethod::Post], operation);
    }
}

/// A refund's body may be empty: utoipa marks a body optional only through `Option<T>`,
/// which would also document a JSON `null` body (answered 400).
struct OptionalBodies;

impl Modify for OptionalBodies {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let refund = openapi
            .paths
            .paths
            .get_mut("/payments/{id}/refund")
            .and_then(|item| item.post.as_mut())
            .and_then(|operation| operation.request_body.as_mut());
        match refund {
            Some(RefOr::T(body)) => body.required = Some(Required::False),
            _ => panic!("the refund's body is documented inline"),
        }
    }
}

/// The document as pretty JSON with a final newline, exactly as committed in `docs/openapi.json`.
pub fn document() -> String {
    let mut json = ApiDoc::openapi().to_pretty_json().expect("the document serializes");
    json.push('\n');
    json
}

static DOCUMENT: LazyLock<String> = LazyLock::new(document);

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "operations", operation_id = "openapi",
    responses((status = 200, description = "The OpenAPI document.", content_type = "application/json")))]
async fn openapi_json() -> HttpResponse {
    HttpResponse::Ok()
        .content_type(mime::APPLICATION_JSON)
        .body(DOCUMENT.as_str())
}

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/openapi.json", web::get().to(openapi_json));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_document_is_the_generated_one() {
        let committed = include_str!("../../docs/openapi.json");
        assert!(
            committed == document(),
            "docs/openapi.json is stale: regenerate it with `make openapi`"
        );
    }

    #[test]
    fn every_route_of_the_contract_is_documented() {
        let doc = ApiDoc::openapi();
        let mut documented: Vec<String> = Vec::new();
        for (path, item) in &doc.paths.paths {
            for (method, operation) in [("GET", &item.get), ("POST", &item.post), ("PATCH", &item.patch)] {
                if operation.is_some() {
                    documented.push(format!("{method} {path}"));
                }
            }
        }
        documented.sort();
        assert_eq!(
            documented,
            [
                "GET /accounts/{id}",
                "GET /healthz",
                "GET /metrics",
                "GET /openapi.json",
                "GET /payments/{id}",
                "GET /readyz",
                "PATCH /admin/tenants/{tenant_id}",
                "POST /accounts",
                "POST /accounts/{id}/deposits",
                "POST /admin/purge",
                "POST /admin/tenants",
                "POST /pay",
                "POST /payments",
                "POST /payments/{id}/refund",
            ]
        );
    }
}
