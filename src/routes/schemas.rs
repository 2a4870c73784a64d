//! Schemas of the OpenAPI document that the handlers' types cannot derive: the values parsed
//! at the edge (their limits come from the same constants as the parsers), the key header,
//! and the problem responses of docs/api.md, Errors.

use utoipa::openapi::header::{Header, HeaderBuilder};
use utoipa::openapi::path::{Parameter, ParameterBuilder, ParameterIn};
use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
use utoipa::openapi::{RefOr, Required, Response, ResponseBuilder, Schema};
use utoipa::{IntoParams, PartialSchema, ToResponse, ToSchema};

use crate::domain::{AccountId, Amount, OpeningBalance, MAX_AMOUNT};
use crate::error::{ProblemCode, RETRY_AFTER_SECS};
use crate::idempotency::key::{HEADER as KEY_HEADER, MAX_LEN as KEY_MAX_LEN};
use std::sync::LazyLock;

fn integer(min: i64, description: &str) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::Integer)
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
        .minimum(Some(min))
        .maximum(Some(MAX_AMOUNT))
        .description(Some(description))
        .into()
}

impl PartialSchema for Amount {
    fn schema() -> RefOr<Schema> {
        integer(
            1,
            "An amount in minor units: a JSON integer (no fraction, no exponent).",
        )
    }
}
impl ToSchema for Amount {}

impl PartialSchema for OpeningBalance {
    fn schema() -> RefOr<Schema> {
        integer(
            0,
            "A balance in minor units: a JSON integer (no fraction, no exponent).",
        )
    }
}
impl ToSchema for OpeningBalance {}

/// The pattern that `AccountId::parse` enforces.
pub const ACCOUNT_ID_PATTERN: &str = "^[A-Za-z0-9_.:-]{1,64}$";

impl PartialSchema for AccountId {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(1))
            .max_length(Some(64))
            .pattern(Some(ACCOUNT_ID_PATTERN))
            .description(Some("An account id; anything else answers 400 `invalid_request`."))
            .into()
    }
}
impl ToSchema for AccountId {}

/// The `Idempotency-Key` request header of every tenant POST.
pub struct IdempotencyKeyHeader;

impl IntoParams for IdempotencyKeyHeader {
    fn into_params(_: impl Fn() -> Option<ParameterIn>) -> Vec<Parameter> {
        let schema = ObjectBuilder::new().schema_type(Type::String).pattern(Some(format!(
            r#"^([!-~]{{1,{KEY_MAX_LEN}}}|"([!#-\[\]-~]|\\["\\]){{1,{KEY_MAX_LEN}}}")$"#
        )));
        vec![ParameterBuilder::new()
            .name(KEY_HEADER)
            .parameter_in(ParameterIn::Header)
            .required(Required::False)
            .description(Some(
                "1 to 255 visible ASCII characters (0x21-0x7E), given once; the structured-field \
                 string form `\"...\"` is accepted and unquoted first. Scoped to the tenant. Without \
                 it, the tenant's `missing_key_policy` decides: `reject` answers 400 \
                 `missing_idempotency_key`.",
            ))
            .schema(Some(schema))
            .build()]
    }
}

fn retry_after() -> Header {
    HeaderBuilder::new()
        .schema(Some(
            ObjectBuilder::new().schema_type(Type::String).pattern(Some("^[0-9]+$")),
        ))
        .description(Some(format!("Seconds to wait before retrying ({RETRY_AFTER_SECS}).")))
        .build()
}

/// A problem+json schema whose `code` is one of `codes` and whose `status` is `status`
/// (`None`: any of docs/api.md's).
fn problem_schema(status: Option<u16>, codes: &[&str]) -> ObjectBuilder {
    let status_schema = ObjectBuilder::new().schema_type(Type::Integer);
    let status_schema = match status {
        Some(status) => status_schema.enum_values(Some([status])),
        None => status_schema.minimum(Some(400)).maximum(Some(599)),
    };
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some("An RFC 9457 problem with a machine-readable `code`."))
        .property("type", ObjectBuilder::new().schema_type(Type::String))
        .property("title", ObjectBuilder::new().schema_type(Type::String))
        .property("status", status_schema)
        .property("detail", ObjectBuilder::new().schema_type(Type::String))
        .property(
            "code",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(codes.iter().copied())),
        )
        .required("type")
        .required("title")
        .required("status")
        .required("detail")
        .required("code")
}

/// Every code of docs/api.md, Errors (and the opaque `internal_error` of a 500, and the
/// dispatcher's `headers_too_large`): the client crate's list.
pub static PROBLEM_CODES: LazyLock<Vec<&'static str>> =
    LazyLock::new(|| ProblemCode::ALL.iter().map(|code| code.as_str()).collect());

/// The `Problem` component: any error of the API.
pub struct Problem;

impl PartialSchema for Problem {
    fn schema() -> RefOr<Schema> {
        problem_schema(None, &PROBLEM_CODES).into()
    }
}
impl ToSchema for Problem {}

fn problem_response(status: u16, codes: &[&str], description: &str) -> Response {
    let mut response = ResponseBuilder::new().description(description).content(
        "application/problem+json",
        utoipa::openapi::content::ContentBuilder::new()
            .schema(Some(problem_schema(Some(status), codes)))
            .build(),
    );
    if matches!(status, 409 | 429 | 503) {
        response = response.header("Retry-After", retry_after());
    }
    response.build()
}

/// The codes answered with `status`.
fn codes_of(status: u16) -> Vec<&'static str> {
    ProblemCode::ALL
        .iter()
        .filter(|code| code.status() == status)
        .map(|code| code.as_str())
        .collect()
}

/// Declares the reusable problem responses, one per status, each with its possible codes.
macro_rules! problem_responses {
    ($($name:ident = $status:literal $description:literal;)+) => {
        $(
            #[doc = $description]
            pub struct $name;

            impl<'r> ToResponse<'r> for $name {
                fn response() -> (&'r str, RefOr<Response>) {
                    (stringify!($name), problem_response($status, &codes_of($status), $description).into())
                }
            }
        )+
    };
}

problem_responses! {
    BadRequest = 400 "A malformed request: nothing was processed or stored.";
    Unauthorized = 401 "No valid bearer token for this endpoint.";
    InsufficientFunds = 402 "Declined: the account's balance is too low (stored with the key and replayed).";
    AdminDisabled = 403 "The admin API is disabled (ONCEPAY_ADMIN_TOKEN is unset).";
    NotFound = 404 "No such resource for this tenant.";
    Conflict = 409 "`request_in_progress` (with Retry-After) or a stored, replayed conflict.";
    RequestTimeout = 408 "The body did not arrive within 5 seconds (a slow or stalled client); nothing was processed.";
    BodyTooLarge = 413 "The body exceeds ONCEPAY_MAX_BODY_BYTES.";
    UnsupportedMediaType = 415 "A body that is not `application/json`, or one sent with a `Content-Encoding` other than `identity`.";
    KeyRefused = 422 "The key was used for another request, or has passed its replay window; nothing was processed.";
    Overloaded = 429 "The service is at capacity; retry after Retry-After.";
    PaymentRequired = 402 "Declined (stored with the key and replayed): `insufficient_funds`, or `card_declined` with the processor's `decline_code`.";
    ProcessorNotConfigured = 501 "Top-ups need a card processor (ONCEPAY_PROCESSOR_URL is unset); not worth a retry.";
    Unavailable = 503 "A transient failure: retry with the same key after Retry-After (a committed request is replayed, an uncommitted one processed).";
}
