//! Reading a body: within the size limit and time (413, 408), of a JSON type (415), parsed
//! strictly into its documented type (400).

use std::time::Duration;

use actix_web::http::header;
use actix_web::{web, HttpMessage, HttpRequest};
use serde_json::Value;

use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// Which body a route expects.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum EmptyBody {
    /// An empty body is invalid JSON.
    Refused,
    /// An empty body means `{}` (a refund takes no parameters).
    MeansEmptyObject,
}

/// Parses a body strictly (400 `invalid_json`) and then into its documented type (400
/// `invalid_request`, naming the field). The JSON value is kept: it is what the fingerprint
/// covers, so that bodies equal as JSON values have equal fingerprints.
pub fn parse_body<T: DeserializeOwned>(bytes: &[u8], empty: EmptyBody) -> Result<(Value, T), ApiError> {
    let value = if empty == EmptyBody::MeansEmptyObject && bytes.iter().all(u8::is_ascii_whitespace) {
        Value::Object(Default::default())
    } else {
        crate::json::parse_strict(bytes).map_err(|e| ApiError::InvalidJson(e.to_string()))?
    };
    // serde would also read a struct from a JSON array (`[]`, `[100, "u1"]`): not documented.
    if !value.is_object() {
        return Err(ApiError::InvalidRequest("the body must be a JSON object".to_owned()));
    }
    let parsed = serde_path_to_error::deserialize(&value).map_err(|err| {
        let path = err.path().to_string();
        let inner = plain_types(&err.into_inner().to_string());
        ApiError::InvalidRequest(if path == "." {
            inner
        } else {
            format!("`{path}`: {inner}")
        })
    })?;
    Ok((value, parsed))
}

/// serde names the Rust type a number was read into (`expected u32`): said in JSON's words
/// instead (the field's own range, where it has one, is checked and named after parsing).
fn plain_types(detail: &str) -> String {
    const TYPES: [(&str, &str); 6] = [
        ("expected u16", "expected a whole number, not negative"),
        ("expected u32", "expected a whole number, not negative"),
        ("expected u64", "expected a whole number, not negative"),
        ("expected i32", "expected a whole number"),
        ("expected i64", "expected a whole number"),
        ("expected f64", "expected a number"),
    ];
    match TYPES.iter().find(|(rust, _)| detail.ends_with(rust)) {
        Some((rust, plain)) => format!("{}{plain}", &detail[..detail.len() - rust.len()]),
        None => detail.to_owned(),
    }
}

/// A call that takes no query parameters refuses any (400), as the lists refuse the ones they
/// do not know: a parameter the server ignored would be a request it did not do
/// (`POST /payments?account=u2` charged `main`). Checked after authentication, with the body.
pub fn no_query(req: &HttpRequest) -> Result<(), ApiError> {
    let query = req.query_string();
    if query.is_empty() {
        return Ok(());
    }
    let first = query.split('&').next().unwrap_or_default();
    let name = first.split('=').next().unwrap_or_default();
    let name = percent_encoding::percent_decode_str(name).decode_utf8_lossy();
    Err(ApiError::InvalidRequest(format!(
        "the query string: `{name}` is not a parameter of this call, which takes none (a request's fields go in its JSON body)"
    )))
}

/// For an optional field whose `null` is not documented: absent is `None` (with
/// `#[serde(default)]`), present must be a value (serde alone reads `null` as `None`).
pub fn present<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    T::deserialize(deserializer).map(Some)
}

/// How long a whole body may take to arrive. actix's `client_request_timeout` bounds only
/// the headers: without this, a body trickled a byte at a time (slowloris) holds its
/// connection for ever.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads at most `limit` bytes (413 beyond) within [`BODY_READ_TIMEOUT`] (408 beyond) and
/// requires a JSON media type, not content-encoded, for a non-empty body (415).
pub async fn read_body(req: &HttpRequest, payload: web::Payload, limit: usize) -> Result<web::Bytes, ApiError> {
    // A declared length over the limit is refused before any of the body is awaited: a
    // client announcing a huge body must not hold a worker waiting for bytes it never sends.
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    let read = tokio::time::timeout(BODY_READ_TIMEOUT, payload.to_bytes_limited(limit)).await;
    let bytes = match read.map_err(|_| ApiError::BodyTimeout {
        secs: BODY_READ_TIMEOUT.as_secs(),
    })? {
        Err(_) => return Err(ApiError::BodyTooLarge { limit }),
        Ok(Err(err)) => return Err(ApiError::InvalidJson(format!("the body could not be read: {err}"))),
        Ok(Ok(bytes)) => bytes,
    };
    if !bytes.is_empty() {
        if let Some(reason) = media_refused(req) {
            return Err(ApiError::UnsupportedMediaType(reason));
        }
    }
    Ok(bytes)
}

/// Why a non-empty body's media type or encoding is refused (415), if it is.
fn media_refused(req: &HttpRequest) -> Option<&'static str> {
    if req.headers().get_all(header::CONTENT_TYPE).nth(1).is_some() {
        // Which one the body is in cannot be told; taking the first would read a body its
        // sender (or a proxy between) took for the other.
        return Some("the request carries two `Content-Type` headers; send one, `application/json`");
    }
    if !is_json(req) {
        return Some("the body must be JSON, sent with `Content-Type: application/json`");
    }
    if !is_utf8(req) {
        return Some("the body must be UTF-8 JSON: a `charset` other than `utf-8` is not read");
    }
    if !is_unencoded(req) {
        return Some("the body must be sent uncompressed: no `Content-Encoding` but `identity` is decoded");
    }
    None
}

/// No `charset` parameter or `utf-8` (RFC 8259, 8.1: JSON exchanged between systems is
/// UTF-8): a body declared in another charset would be read as UTF-8 bytes it is not.
fn is_utf8(req: &HttpRequest) -> bool {
    match req.mime_type() {
        Ok(Some(mime)) => mime
            .get_param(mime::CHARSET)
            .is_none_or(|charset| charset == mime::UTF_8 || charset.as_str().eq_ignore_ascii_case("utf8")),
        _ => true,
    }
}

/// No `Content-Encoding` but `identity`: the server decodes none (RFC 9110, 8.4: a body in
/// an encoding the server does not accept is 415), and a compressed body read as JSON would be
/// a misleading 400 `invalid_json`, or worse, some other bytes taken for the request.
fn is_unencoded(req: &HttpRequest) -> bool {
    req.headers().get_all(header::CONTENT_ENCODING).all(|value| {
        value.to_str().is_ok_and(|v| {
            v.split(',')
                .all(|coding| coding.trim().eq_ignore_ascii_case("identity"))
        })
    })
}

fn is_json(req: &HttpRequest) -> bool {
    match req.mime_type() {
        Ok(Some(mime)) => {
            mime.type_() == mime::APPLICATION && (mime.subtype() == mime::JSON || mime.suffix() == Some(mime::JSON))
        }
        _ => false,
    }
}
