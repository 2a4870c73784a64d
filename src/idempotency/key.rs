//! The `Idempotency-Key` header (contract section 5, rule 1).

use actix_web::http::header::HeaderMap;

pub const HEADER: &str = "Idempotency-Key";
pub const MAX_LEN: usize = 255;

/// A client's key: 1..=255 characters of visible ASCII (0x21-0x7E).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Parses a header value, accepting the RFC 8941 string form `"..."` (unquoted first;
    /// the rule applies to the unquoted key). Only a value that starts *and* ends with `"`
    /// is in that form; any other value is a plain key, quotes included.
    pub fn parse(raw: &[u8]) -> Result<Self, &'static str> {
        let key = match raw {
            [b'"', inner @ .., b'"'] => unquote(inner)?,
            _ => raw.to_vec(),
        };
        if key.is_empty() {
            return Err("the key is empty");
        }
        if key.len() > MAX_LEN {
            return Err("the key is longer than 255 characters");
        }
        if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
            return Err("the key may only contain visible ASCII characters (0x21-0x7E), no spaces");
        }
        // Every byte is ASCII, so this cannot fail.
        String::from_utf8(key).map(Self).map_err(|_| "the key is not ASCII")
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

/// RFC 8941 sf-string body: `\"` and `\\` are the only escapes.
fn unquote(inner: &[u8]) -> Result<Vec<u8>, &'static str> {
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err("a quoted key may only escape '\"' and '\\'"),
            },
            b'"' => return Err("a quoted key contains an unescaped '\"'"),
            _ => out.push(b),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn plain_and_quoted_keys() {
        assert_eq!(IdempotencyKey::parse(b"abc-123").unwrap().as_str(), "abc-123");
        assert_eq!(IdempotencyKey::parse(b"\"abc\"").unwrap().as_str(), "abc");
        assert_eq!(IdempotencyKey::parse(br#""a\"b\\c""#).unwrap().as_str(), r#"a"b\c"#);
        assert_eq!(IdempotencyKey::parse(&[b'k'; 255]).unwrap().as_str().len(), 255);
        // Not the quoted form: a plain key that happens to contain quotes.
        assert_eq!(IdempotencyKey::parse(b"\"abc").unwrap().as_str(), "\"abc");
        assert_eq!(IdempotencyKey::parse(b"\"").unwrap().as_str(), "\"");
    }

    #[test]
    fn refused_keys() {
        for bad in [
            &b""[..],
            b"\"\"",
            b"\"a b\"",
            b"a b",
            b"\"a\\nb\"",
            b"caf\xc3\xa9",
            b"a\x01b",
            b"a\x7fb",
        ] {
            assert!(IdempotencyKey::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(IdempotencyKey::parse(&[b'k'; 256]).is_err());
    }

    proptest! {
        #[test]
        fn visible_ascii_keys_round_trip(key in "[\\x21-\\x7e]{1,255}") {
            prop_assume!(!(key.len() >= 2 && key.starts_with('"') && key.ends_with('"')));
            let parsed = IdempotencyKey::parse(key.as_bytes()).unwrap();
            prop_assert_eq!(parsed.as_str(), key.as_str());
        }

        #[test]
        fn quoting_a_key_changes_nothing(key in "[\\x21-\\x7e]{1,200}") {
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            let parsed = IdempotencyKey::parse(quoted.as_bytes()).unwrap();
            prop_assert_eq!(parsed.as_str(), key.as_str());
        }

        #[test]
        fn keys_with_a_forbidden_byte_are_refused(
            prefix in "[a-z]{0,20}",
            bad in prop_oneof![0u8..=0x20, 0x7fu8..=0xff],
            suffix in "[a-z]{0,20}",
        ) {
            let mut key = prefix.into_bytes();
            key.push(bad);
            key.extend(suffix.into_bytes());
            prop_assert!(IdempotencyKey::parse(&key).is_err());
        }

        #[test]
        fn keys_longer_than_255_are_refused(key in "[a-z]{256,400}") {
            prop_assert!(IdempotencyKey::parse(key.as_bytes()).is_err());
        }

        /// The length rule applies to the unquoted key: 255 escaped characters pass, 256 do not.
        #[test]
        fn quoted_keys_obey_the_length_limit_after_unquoting(key in "[\"\\\\a-z]{250,260}") {
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            prop_assert_eq!(IdempotencyKey::parse(quoted.as_bytes()).is_ok(), key.len() <= MAX_LEN);
        }

        #[test]
        fn quoted_keys_with_a_forbidden_byte_or_a_bad_escape_are_refused(
            prefix in "[a-z]{0,20}",
            bad in prop_oneof![
                (0u8..=0x20).prop_map(|b| vec![b]),
                (0x7fu8..=0xff).prop_map(|b| vec![b]),
                Just(b"\"".to_vec()),
                "[a-zA-Z0-9]".prop_map(|c| format!("\\{c}").into_bytes()),
            ],
            suffix in "[a-z]{0,20}",
        ) {
            let mut key = b"\"".to_vec();
            key.extend(prefix.into_bytes());
            key.extend(bad);
            key.extend(suffix.into_bytes());
            key.push(b'"');
            prop_assert!(IdempotencyKey::parse(&key).is_err(), "{:?}", String::from_utf8_lossy(&key));
        }

        /// Whatever the bytes, parsing never panics, and what it accepts keeps the invariant.
        #[test]
        fn any_bytes_parse_to_a_valid_key_or_an_error(raw in prop::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(key) = IdempotencyKey::parse(&raw) {
                prop_assert!((1..=MAX_LEN).contains(&key.as_str().len()));
                prop_assert!(key.as_str().bytes().all(|b| (0x21..=0x7e).contains(&b)));
            }
        }
    }
}
