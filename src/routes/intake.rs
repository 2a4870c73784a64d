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
        let inner = err.into_inner();
        ApiError::InvalidRequest(if path == "." {
            inner.to_string()
        } else {
            format!("`{path}`: {inner}")
        })
    })?;
    Ok((value, parsed))
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
    let plain_json = is_json(req) && is_unencoded(req);
    if !bytes.is_empty() && !plain_json {
        return Err(ApiError::UnsupportedMediaType);
    }
    Ok(bytes)
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
