//! What every list shares (docs/api.md, Lists): Stripe's parameters read from the query
//! string into a [`PageRequest`] and the list's filters (400 `invalid_request`, naming the
//! parameter, for anything else), the answer `{"object":"list","data","has_more","url"}`, and
//! their OpenAPI description.

use actix_web::http::header::ContentType;
use actix_web::{web, HttpRequest, HttpResponse, ResponseError};
use chrono::{DateTime, TimeZone, Utc};
use serde::{Deserialize, Serialize};
use utoipa::openapi::path::{Parameter, ParameterBuilder, ParameterIn};
use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
use utoipa::openapi::Required;
use utoipa::ToSchema;

use crate::domain::page::{Created, Cursor, Page, PageRequest, DEFAULT_LIMIT, MAX_LIMIT};
use crate::domain::AccountId;
use crate::error::ApiError;

/// A list's answer.
#[derive(Serialize, ToSchema)]
pub struct ListOut<T> {
    /// Always `list`.
    object: &'static str,
    /// The page's items, newest first, each as its single `GET` shows it.
    data: Vec<T>,
    /// More items lie beyond this page, in the direction it was read: older after
    /// `starting_after` (or with no cursor), newer before `ending_before`.
    has_more: bool,
    /// The list's path.
    url: String,
}

/// The room an item of a list is given in the answer's buffer: more than a payment's, a
/// transfer's or an event's JSON needs.
const ITEM_BYTES: usize = 512;

/// An item of a list, as a page writes it.
pub trait ListItem: Serialize {
    /// Appends the item's JSON to `out`, the bytes its `Serialize` writes: by default through
    /// it. A list read by the thousand writes its own (`PaymentStateOut`'s), held to this by
    /// a property test.
    fn write_json(&self, out: &mut Vec<u8>) -> Result<(), sonic_rs::Error> {
        sonic_rs::to_writer(out, self)
    }
}

/// Answers a page of the list at `url`: the bytes serde_json writes for its [`ListOut`].
///
/// Written by sonic-rs, not serde_json as every other answer (the same bytes:
/// `a_page_is_written_as_serde_json_writes_its_list`), because its strings are scanned for
/// escapes 16 bytes at a time. A page of 100 payments is about 20 KB of strings, and serde_json's
/// escape scan, a byte at a time, was 16 % of the server's instructions for it (`make
/// callgrind`, list phase: 805k -> 729k a page). The envelope's keys are written as they are,
/// and each item by its [`ListItem`].
pub fn answer<T: ListItem>(url: String, page: Page<T>) -> HttpResponse {
    match write(&url, &page.items, page.has_more) {
        Ok(body) => HttpResponse::Ok().content_type(ContentType::json()).body(body),
        // Only a map with keys that are not strings or a failing `Serialize` could get here,
        // and no answer of oncepay's has either; were one to, a logged 500 problem+json.
        Err(e) => ApiError::Internal(anyhow::anyhow!("a list page could not be written: {e}")).error_response(),
    }
}

/// A list's JSON, as serde_json writes `ListOut { object: "list", data: items, has_more, url }`.
fn write<T: ListItem>(url: &str, items: &[T], has_more: bool) -> Result<Vec<u8>, sonic_rs::Error> {
    // Room for the whole page at once (an item of any list is a few hundred bytes): grown
    // from a small buffer, a page of 100 payments was copied eight times over.
    let mut body = Vec::with_capacity(256 + items.len() * ITEM_BYTES);
    body.extend_from_slice(br#"{"object":"list","data":["#);
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        item.write_json(&mut body)?;
    }
    body.extend_from_slice(if has_more {
        br#"],"has_more":true,"url":"#
    } else {
        br#"],"has_more":false,"url":"#
    });
    sonic_rs::to_writer(&mut body, url)?;
    body.push(b'}');
    Ok(body)
}

/// A cursor that names no item of the list (unknown, another list's or another tenant's, or
/// purged since), named by its parameter.
pub fn unknown_cursor<Id>(page: &PageRequest<Id>) -> ApiError {
    let name = match page.cursor {
        Some(Cursor::Before(_)) => "ending_before",
        _ => "starting_after",
    };
    ApiError::InvalidRequest(format!(
        "`{name}` is not the id of an item of this list (unknown, another list's or another tenant's, or purged since)"
    ))
}

/// An `account` filter, parsed.
pub fn account(filters: &Filters) -> Result<Option<AccountId>, ApiError> {
    filters
        .account
        .as_deref()
        .map(AccountId::parse)
        .transpose()
        .map_err(|e| ApiError::InvalidRequest(format!("`account`: {e}")))
}

/// The filters a list may take besides the page's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filter {
    /// `account`: an account id.
    Account,
    /// `status`: one of these.
    Status(&'static [&'static str]),
    /// `type`: an event type.
    Type(&'static [&'static str]),
    /// `outcome`: `succeeded` or `failed`.
    Outcome,
}

impl Filter {
    fn name(self) -> &'static str {
        match self {
            Self::Account => "account",
            Self::Status(_) => "status",
            Self::Type(_) => "type",
            Self::Outcome => "outcome",
        }
    }
}

/// Every parameter any list takes; each list refuses those it does not.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQuery {
    limit: Option<String>,
    starting_after: Option<String>,
    ending_before: Option<String>,
    #[serde(rename = "created[gte]")]
    created_gte: Option<String>,
    #[serde(rename = "created[gt]")]
    created_gt: Option<String>,
    #[serde(rename = "created[lte]")]
    created_lte: Option<String>,
    #[serde(rename = "created[lt]")]
    created_lt: Option<String>,
    account: Option<String>,
    status: Option<String>,
    #[serde(rename = "type")]
    event_type: Option<String>,
    outcome: Option<String>,
}

/// The filters a request gave (each already one of its allowed values, but for `account`,
/// which the caller parses).
#[derive(Debug, Default)]
pub struct Filters {
    pub account: Option<String>,
    pub status: Option<String>,
    pub event_type: Option<String>,
    pub outcome: Option<String>,
}

/// Reads a list's query string: the page (its cursor parsed by `cursor`, `None` for an id
/// that cannot name an item of the list) and the filters of `allowed`.
pub fn query<Id>(
    req: &HttpRequest,
    allowed: &[Filter],
    cursor: impl Fn(&str) -> Option<Id>,
) -> Result<(PageRequest<Id>, Filters), ApiError> {
    let raw = web::Query::<RawQuery>::from_query(req.query_string())
        .map_err(|e| ApiError::InvalidRequest(format!("the query string: {}", inner(&e.to_string()))))?
        .into_inner();
    let limit = match raw.limit.as_deref() {
        None => DEFAULT_LIMIT,
        Some(raw) => raw
            .parse()
            .map_err(|_| ApiError::InvalidRequest(format!("`limit` must be an integer between 1 and {MAX_LIMIT}")))?,
    };
    let parse_cursor = |name: &str, raw: &str| {
        cursor(raw)
            .ok_or_else(|| ApiError::InvalidRequest(format!("`{name}`: {raw:?} is not the id of an item of this list")))
    };
    let cursor = match (raw.starting_after.as_deref(), raw.ending_before.as_deref()) {
        (Some(_), Some(_)) => {
            return Err(ApiError::InvalidRequest(
                "give `starting_after` or `ending_before`, not both".to_owned(),
            ))
        }
        (Some(after), None) => Some(Cursor::After(parse_cursor("starting_after", after)?)),
        (None, Some(before)) => Some(Cursor::Before(parse_cursor("ending_before", before)?)),
        (None, None) => None,
    };
    let created = created(&raw)?;
    let page = PageRequest::new(limit, cursor, created).map_err(ApiError::InvalidRequest)?;

    let mut filters = Filters::default();
    for (name, value, slot) in [
        ("account", raw.account, &mut filters.account),
        ("status", raw.status, &mut filters.status),
        ("type", raw.event_type, &mut filters.event_type),
        ("outcome", raw.outcome, &mut filters.outcome),
    ] {
        let Some(value) = value else { continue };
        let filter = allowed
            .iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| ApiError::InvalidRequest(format!("`{name}` is not a parameter of this list")))?;
        let values: &[&str] = match filter {
            Filter::Status(values) | Filter::Type(values) => values,
            Filter::Outcome => &["succeeded", "failed"],
            Filter::Account => &[],
        };
        if !values.is_empty() && !values.contains(&value.as_str()) {
            return Err(ApiError::InvalidRequest(format!(
                "`{name}`: {value:?} is not one of {}",
                values.join(", ")
            )));
        }
        *slot = Some(value);
    }
    Ok((page, filters))
}

/// serde's message without the extractor's prefix.
fn inner(message: &str) -> &str {
    message.strip_prefix("Query deserialize error: ").unwrap_or(message)
}

/// The last second a `created` filter may name, 9999-12-31T23:59:59Z (as `recover`'s `since`).
const LATEST_CREATED: i64 = 253_402_300_799;

/// `created[gte|gt|lte|lt]` in whole Unix seconds from 0 (the schema's minimum: nothing here
/// was created before 1970), as one range: `[from, until)`. A time in seconds names that
/// whole second (Stripe's times have no fraction): `lte` includes it, `gt` excludes it.
fn created(raw: &RawQuery) -> Result<Created, ApiError> {
    let seconds = |name: &str, value: &Option<String>| -> Result<Option<i64>, ApiError> {
        value
            .as_deref()
            .map(|v| {
                v.parse::<i64>()
                    .ok()
                    .filter(|s| (0..=LATEST_CREATED).contains(s))
                    .ok_or_else(|| {
                        ApiError::InvalidRequest(format!(
                            "`created[{name}]` must be a time in Unix seconds, from 0 to {LATEST_CREATED} (1970 to 9999)"
                        ))
                    })
            })
            .transpose()
    };
    let from = [
        seconds("gte", &raw.created_gte)?,
        seconds("gt", &raw.created_gt)?.map(|s| s + 1),
    ]
    .into_iter()
    .flatten()
    .max();
    let until = [
        seconds("lt", &raw.created_lt)?,
        seconds("lte", &raw.created_lte)?.map(|s| s + 1),
    ]
    .into_iter()
    .flatten()
    .min();
    Ok(Created {
        from: from.and_then(time),
        until: until.and_then(time),
    })
}

fn time(seconds: i64) -> Option<DateTime<Utc>> {
    Utc.timestamp_opt(seconds, 0).single()
}

/// The query parameters of a list taking `filters`, for the OpenAPI document.
pub fn parameters(filters: &[Filter]) -> Vec<Parameter> {
    let integer = |min: i64, max: Option<i64>| {
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
            .minimum(Some(min))
            .maximum(max)
    };
    let string = || ObjectBuilder::new().schema_type(Type::String);
    let param = |name: &str, schema: ObjectBuilder, description: &str| {
        ParameterBuilder::new()
            .name(name)
            .parameter_in(ParameterIn::Query)
            .required(Required::False)
            .schema(Some(schema))
            .description(Some(description))
            .build()
    };
    let mut params = vec![
        param(
            "limit",
            integer(1, Some(i64::from(MAX_LIMIT))).default(Some(DEFAULT_LIMIT.into())),
            "Items per page, 1 to 100 (default 10).",
        ),
        param(
            "starting_after",
            string(),
            "The id of an item of this list: the page holds the items after it (older). 400 \
             `invalid_request` for an id that is malformed, unknown, or another tenant's.",
        ),
        param(
            "ending_before",
            string(),
            "The id of an item of this list: the page holds the items before it (newer), still \
             newest first. Not with `starting_after`.",
        ),
    ];
    for (op, description) in [
        ("gte", "Created at or after this Unix time (seconds)."),
        ("gt", "Created after this Unix second."),
        (
            "lte",
            "Created at or before this Unix second (the whole second included).",
        ),
        ("lt", "Created before this Unix time (seconds)."),
    ] {
        params.push(param(
            &format!("created[{op}]"),
            integer(0, Some(LATEST_CREATED)),
            description,
        ));
    }
    for filter in filters {
        let (schema, description) = match filter {
            Filter::Account => (
                string().pattern(Some(super::schemas::ACCOUNT_ID_PATTERN)),
                "Only this account's (for transfers: on either side).".to_owned(),
            ),
            Filter::Status(values) => (
                string().enum_values(Some(values.iter().copied())),
                "Only those of this status.".to_owned(),
            ),
            Filter::Type(values) => (
                string().enum_values(Some(values.iter().copied())),
                "Only events of this type.".to_owned(),
            ),
            Filter::Outcome => (
                string().enum_values(Some(["succeeded", "failed"])),
                "`failed`: attempts without a 2xx (another status, or no answer); `succeeded`: the 2xx ones."
                    .to_owned(),
            ),
        };
        params.push(param(filter.name(), schema, &description));
    }
    params
}

#[cfg(test)]
mod tests {
    use actix_web::test::TestRequest;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    use super::*;

    /// Any JSON value: strings of any characters (control characters, quotes, backslashes,
    /// astral ones), integers and floats of any size, nested arrays and objects.
    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
                .prop_map(Value::from),
            any::<String>().prop_map(Value::String),
            "[\\x00-\\x1f\"\\\\/\\u{7f}-\\u{a0}\\u{2028}\\u{2029}a-z]{0,40}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map(any::<String>(), inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    impl ListItem for Value {}

    proptest! {
        /// The page, its envelope and items written by sonic-rs through `Serialize`: the bytes
        /// of serde_json.
        #[test]
        fn a_page_is_written_as_serde_json_writes_its_list(data in prop::collection::vec(value(), 0..4), has_more: bool, url: String) {
            let ours = write(&url, &data, has_more).unwrap();
            let serde = serde_json::to_vec(&ListOut { object: "list", data, has_more, url }).unwrap();
            prop_assert_eq!(String::from_utf8_lossy(&ours), String::from_utf8_lossy(&serde));
        }
    }

    #[actix_web::test]
    async fn a_page_answers_as_json_with_the_lists_shape() {
        let page = Page {
            items: vec![json!({"id": "a\u{1}\"b"}), json!(12)],
            has_more: true,
        };
        let response = answer("/payments".to_owned(), page);
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers().get("content-type").unwrap(), "application/json");
        let body = actix_web::body::to_bytes(response.into_body()).await.unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&body).unwrap(),
            json!({"object": "list", "data": [{"id": "a\u{1}\"b"}, 12], "has_more": true, "url": "/payments"})
        );
    }

    fn read(query: &str, allowed: &[Filter]) -> Result<(PageRequest<u32>, Filters), String> {
        let req = TestRequest::get().uri(&format!("/x?{query}")).to_http_request();
        query_of(&req, allowed).map_err(|e| e.to_string())
    }

    fn query_of(req: &HttpRequest, allowed: &[Filter]) -> Result<(PageRequest<u32>, Filters), ApiError> {
        query(req, allowed, |raw| raw.parse().ok())
    }

    #[test]
    fn the_page_is_read_from_stripes_parameters() {
        let (page, _) = read("limit=3&starting_after=7&created%5Bgte%5D=100&created[lte]=200", &[]).unwrap();
        assert_eq!(page.fetch(), 4);
        assert_eq!(page.cursor, Some(Cursor::After(7)));
        assert_eq!(page.created.from, time(100));
        assert_eq!(page.created.until, time(201), "lte includes its whole second");
        let (page, _) = read("ending_before=7&created[gt]=100&created[lt]=200", &[]).unwrap();
        assert_eq!(page.cursor, Some(Cursor::Before(7)));
        assert_eq!((page.created.from, page.created.until), (time(101), time(200)));
        let (page, _) = read("", &[]).unwrap();
        assert_eq!((page.fetch(), page.cursor), (11, None));
    }

    #[test]
    fn bad_parameters_are_refused_naming_them() {
        for (query, named) in [
            ("limit=0", "limit"),
            ("limit=101", "limit"),
            ("limit=ten", "limit"),
            ("starting_after=x", "starting_after"),
            ("starting_after=1&ending_before=2", "starting_after"),
            ("created[gte]=yesterday", "created[gte]"),
            ("created[lt]=1.5", "created[lt]"),
            ("created[gte]=9223372036854775807", "to 253402300799"),
            ("created[lte]=-1", "from 0"),
            ("account=u1", "account"),
            ("colour=red", "colour"),
            ("limit=1&limit=2", "limit"),
            ("status=lost", "status"),
        ] {
            let err = read(query, &[Filter::Status(&["succeeded"])]).unwrap_err();
            assert!(err.contains(named), "{query}: {err}");
        }
        let (_, filters) = read("status=succeeded", &[Filter::Status(&["succeeded"])]).unwrap();
        assert_eq!(filters.status.as_deref(), Some("succeeded"));
    }
}
