//! The `Idempotency-Key` header (docs/api.md, Idempotency, rule 1). The syntax is the one the
//! client obeys too, written once in the crate `oncepay-protocol`; reading it out of the
//! request's headers is the server's part.

use actix_web::http::header::HeaderMap;
use oncepay_protocol::parse_key_header;

pub use oncepay_protocol::{KEY_HEADER as HEADER, KEY_MAX_LEN as MAX_LEN};

/// A client's key: 1..=255 characters of visible ASCII (0x21-0x7E).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Parses a header value, accepting the RFC 8941 string form `"..."` (unquoted first;
    /// the rule applies to the unquoted key).
    pub fn parse(raw: &[u8]) -> Result<Self, &'static str> {
        parse_key_header(raw).map(Self).map_err(|why| why.message())
    }

    /// Reads the key from the request headers: `Ok(None)` when absent.
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<Self>, &'static str> {
        let mut values = headers.get_all(HEADER);
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err("the header was given more than once");
        }
        Self::parse(first.as_bytes()).map(Some)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::http::header::{HeaderName, HeaderValue};

    fn headers(values: &[&[u8]]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for value in values {
            map.append(
                HeaderName::from_static("idempotency-key"),
                HeaderValue::from_bytes(value).unwrap(),
            );
        }
        map
    }

    #[test]
    fn the_header_is_read_with_the_shared_syntax() {
        assert_eq!(IdempotencyKey::from_headers(&headers(&[])), Ok(None));
        let key = IdempotencyKey::from_headers(&headers(&[b"\"a\\\"b\""]))
            .unwrap()
            .unwrap();
        assert_eq!(key.as_str(), "a\"b");
        assert_eq!(
            IdempotencyKey::from_headers(&headers(&[b"a b"])),
            Err("the key may only contain visible ASCII characters (0x21-0x7E), no spaces")
        );
    }

    #[test]
    fn a_header_given_twice_is_refused() {
        assert_eq!(
            IdempotencyKey::from_headers(&headers(&[b"k1", b"k2"])),
            Err("the header was given more than once")
        );
    }
}
