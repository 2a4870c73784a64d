//! The OpenAPI document of the whole API, served at `GET /openapi.json`: the idempotent
//! operations are generated from the operation table and their `Endpoint` types
//! ([`document_operation`]), the other routes from their handlers' annotations. `oncepay openapi` prints it; `docs/openapi.json` is the
//! committed copy (a test fails when they differ: regenerate with `make openapi`).

use std::sync::LazyLock;

use actix_web::{web, HttpResponse};
use utoipa::openapi::content::ContentBuilder;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Ref, Required, ResponseBuilder};
use utoipa::{IntoParams, Modify, OpenApi, PartialSchema, ToSchema};

use super::intake::EmptyBody;
use super::pipeline::{self, Endpoint};
use super::schemas::{
    AdminDisabled, BadRequest, BodyTooLarge, Conflict, IdempotencyKeyHeader, InsufficientFunds, KeyRefused, NotFound,
    Overloaded, Problem, RequestTimeout, Unauthorized, Unavailable, UnsupportedMediaType,
};
use super::{accounts, admin, health, keys, payments, recovery, top_ups, transfers, webhooks};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "oncepay",
        description = "A payment API whose retried requests never charge twice. Every tenant POST takes an \
            `Idempotency-Key`; every error is `application/problem+json` with a machine-readable `code`.",
        license(name = "MIT", identifier = "MIT"),
    ),
    paths(
        payments::show, accounts::show, transfers::show,
        payments::list, transfers::list, accounts::list, top_ups::list,
        top_ups::create, top_ups::show, top_ups::refund,
        webhooks::list, webhooks::delete, webhooks::show_event,
        recovery::list_events, recovery::list_attempts, keys::show,
        admin::create_tenant, admin::update_tenant, admin::create_api_key, admin::list_api_keys,
        admin::revoke_api_key, admin::run_purge,
        health::healthz, health::readyz, openapi_json,
    ),
    components(
        schemas(Problem),
        responses(
            BadRequest, Unauthorized, InsufficientFunds, AdminDisabled, NotFound, Conflict, RequestTimeout, BodyTooLarge,
            UnsupportedMediaType, KeyRefused, Overloaded, Unavailable, super::schemas::PaymentRequired,
            super::schemas::ProcessorNotConfigured,
        ),
    ),
    modifiers(&BearerSchemes, &Operations),
    tags(
        (name = "payments", description = "Charges and refunds."),
        (name = "accounts", description = "Accounts and deposits."),
        (name = "transfers", description = "Transfers between two accounts of a tenant."),
        (name = "top-ups", description = "Card top-ups through a processor speaking Stripe's API: charged at most once, credited exactly once iff charged."),
        (name = "webhooks", description = "Endpoints that receive the tenant's events (Standard Webhooks: signed, at least once, same `webhook-id` on every attempt; docs/webhooks.md)."),
        (name = "admin", description = "Operators: `Authorization: Bearer <ONCEPAY_ADMIN_TOKEN>`."),
        (name = "operations", description = "Probes and this document. `GET /metrics` is served on the operations listener (`ONCEPAY_METRICS_BIND`, loopback by default), not here."),
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

/// The idempotent operations, each documented from its table entry and its `Endpoint`.
struct Operations;

impl Modify for Operations {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        document_operation::<payments::CreatePayment>(openapi);
        document_operation::<payments::RefundPayment>(openapi);
        document_operation::<accounts::OpenAccount>(openapi);
        document_operation::<accounts::CreateDeposit>(openapi);
        document_operation::<transfers::CreateTransfer>(openapi);
        document_operation::<webhooks::CreateWebhookEndpoint>(openapi);
        document_operation::<webhooks::RotateWebhookSecret>(openapi);
        document_operation::<webhooks::EnableWebhookEndpoint>(openapi);
        document_operation::<recovery::ResendWebhookEvent>(openapi);
        document_operation::<recovery::RecoverWebhookEndpoint>(openapi);
        // The admin calls that take no body (admin::NoParametersIn): one may be sent, `{}`.
        for path in ["/admin/purge", "/admin/tenants/{tenant_id}/api-keys"] {
            let body = openapi
                .paths
                .paths
                .get_mut(path)
                .and_then(|item| item.post.as_mut())
                .and_then(|post| post.request_body.as_mut());
            if let Some(utoipa::openapi::RefOr::T(body)) = body {
                body.required = Some(Required::False);
            }
        }
    }
}

/// Documents one operation: its path (and aliases), body, answer, and every status it can
/// answer: the common ones of a keyed POST plus the statuses of its declines.
fn document_operation<E: Endpoint>(openapi: &mut utoipa::openapi::OpenApi) {
    let spec = pipeline::spec::<E>();
    let components = openapi.components.get_or_insert_with(Default::default);
    let mut schemas = vec![
        (E::In::name().into_owned(), E::In::schema()),
        (E::Out::name().into_owned(), E::Out::schema()),
    ];
    E::In::schemas(&mut schemas);
    E::Out::schemas(&mut schemas);
    components.schemas.extend(schemas);

    let replayed = HeaderBuilder::new()
        .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
        .description(Some(
            "`true` on a replay, `false` on a first answer; absent without a key",
        ))
        .build();
    let mut success = ResponseBuilder::new()
        .description("Done (or the replay of the first answer).")
        .header("Idempotency-Replayed", replayed)
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name(E::Out::name())))
                .build(),
        );
    if spec.operation == crate::operation::Operation::Pay || spec.operation == crate::operation::Operation::Transfer {
        success = success.header(
            "Location",
            HeaderBuilder::new()
                .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
                .description(Some("The created resource, whose current state `GET` answers."))
                .build(),
        );
    }
    let mut statuses: Vec<(u16, &str)> = vec![
        (400, "BadRequest"),
        (401, "Unauthorized"),
        (408, "RequestTimeout"),
        (409, "Conflict"),
        (413, "BodyTooLarge"),
        (415, "UnsupportedMediaType"),
        (422, "KeyRefused"),
        (429, "Overloaded"),
        (503, "Unavailable"),
    ];
    for decline in spec.declines {
        let response = match decline.status() {
            402 => "InsufficientFunds",
            404 => "NotFound",
            _ => "Conflict",
        };
        statuses.push((decline.status(), response));
    }
    statuses.sort_unstable();
    statuses.dedup();

    let body_required = match E::EMPTY_BODY {
        EmptyBody::Refused => Required::True,
        EmptyBody::MeansEmptyObject => Required::False,
    };
    let mut operation = OperationBuilder::new()
        .operation_id(Some(spec.name))
        .summary(Some(spec.summary))
        .tag(spec.tag)
        .request_body(Some(
            RequestBodyBuilder::new()
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name(E::In::name())))
                        .build(),
                )
                .required(Some(body_required))
                .build(),
        ))
        .parameters(Some(IdempotencyKeyHeader::into_params(|| None)))
        .securities(Some([SecurityRequirement::new("api_key", Vec::<String>::new())]))
        .response(spec.success_status.to_string(), success.build());
    let parameters = spec
        .path
        .split('/')
        .filter_map(|segment| segment.strip_prefix('{')?.strip_suffix('}'));
    for name in parameters {
        operation = operation.parameter(
            ParameterBuilder::new()
                .name(name)
                .parameter_in(ParameterIn::Path)
                .required(Required::True)
                .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
                .description(Some("The resource's id; another tenant's answers 404.")),
        );
    }
    for (status, response) in statuses {
        operation = operation.response(status.to_string(), Ref::from_response_name(response));
    }
    let operation = operation.build();
    for alias in spec.aliases {
        let mut alias_operation = operation.clone();
        alias_operation.operation_id = Some(alias.trim_start_matches('/').to_owned());
        alias_operation.summary = Some(format!(
            "Alias of `{} {}` (same operation, same fingerprint path).",
            spec.method, spec.path
        ));
        openapi
            .paths
            .add_path_operation(alias, vec![HttpMethod::Post], alias_operation);
    }
    openapi
        .paths
        .add_path_operation(spec.path, vec![HttpMethod::Post], operation);
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
    cfg.route("/openapi.json", super::get().to(openapi_json));
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
            for (method, operation) in [
                ("GET", &item.get),
                ("POST", &item.post),
                ("PATCH", &item.patch),
                ("DELETE", &item.delete),
            ] {
                if operation.is_some() {
                    documented.push(format!("{method} {path}"));
                }
            }
        }
        documented.sort();
        assert_eq!(
            documented,
            [
                "DELETE /admin/tenants/{tenant_id}/api-keys/{key_id}",
                "DELETE /webhook-endpoints/{id}",
                "GET /accounts",
                "GET /accounts/{id}",
                "GET /admin/tenants/{tenant_id}/api-keys",
                "GET /events",
                "GET /events/{id}",
                "GET /healthz",
                "GET /idempotency-keys/{key}",
                "GET /openapi.json",
                "GET /payments",
                "GET /payments/{id}",
                "GET /readyz",
                "GET /top-ups",
                "GET /top-ups/{id}",
                "GET /transfers",
                "GET /transfers/{id}",
                "GET /webhook-endpoints",
                "GET /webhook-endpoints/{id}/attempts",
                "PATCH /admin/tenants/{tenant_id}",
                "POST /accounts",
                "POST /accounts/{id}/deposits",
                "POST /accounts/{id}/top-ups",
                "POST /admin/purge",
                "POST /admin/tenants",
                "POST /admin/tenants/{tenant_id}/api-keys",
                "POST /pay",
                "POST /payments",
                "POST /payments/{id}/refund",
                "POST /top-ups/{id}/refund",
                "POST /transfers",
                "POST /webhook-endpoints",
                "POST /webhook-endpoints/{id}/enable",
                "POST /webhook-endpoints/{id}/events/{event_id}/resend",
                "POST /webhook-endpoints/{id}/recover",
                "POST /webhook-endpoints/{id}/rotate-secret",
            ]
        );
    }

    /// The tenant routes the client and the server share (`oncepay_protocol::routes`) are
    /// exactly the documented tenant endpoints: the `utoipa::path` attributes spell the read
    /// paths as literals, so this ties them to the shared table.
    #[test]
    fn the_documented_tenant_routes_are_the_shared_ones() {
        let document: serde_json::Value = serde_json::from_str(&document()).unwrap();
        let mut documented: Vec<String> = Vec::new();
        for (path, operations) in document["paths"].as_object().unwrap() {
            if path.starts_with("/admin")
                || ["/healthz", "/readyz", "/metrics", "/openapi.json"].contains(&path.as_str())
            {
                continue;
            }
            for method in operations.as_object().unwrap().keys() {
                documented.push(format!("{} {path}", method.to_uppercase()));
            }
        }
        let mut shared: Vec<String> = oncepay_protocol::routes::TENANT_ROUTES
            .iter()
            .map(|r| format!("{} {}", r.method, r.path))
            .collect();
        documented.sort();
        shared.sort();
        assert_eq!(documented, shared);
    }
}
