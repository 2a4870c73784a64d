//! The `Idempotency-Key` syntax: 1..=255 visible ASCII characters (0x21-0x7E). A header
//! value in the RFC 8941 string form `"..."` is unquoted first, and the rule applies to the
//! unquoted key.

use std::fmt;

/// The longest key, in characters (bytes: every key character is ASCII).
pub const KEY_MAX_LEN: usize = 255;

/// The prefix of the keys a server derives for requests without one (policy `fingerprint`):
/// reserved, so that no client's key can stand for another request's derived one.
pub const DERIVED_KEY_PREFIX: &str = "fp:";

/// Why a key or a header value is not a valid key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeySyntaxError {
    Empty,
    TooLong,
    InvalidCharacter,
    BadEscape,
    UnescapedQuote,
    /// A key in the server's own namespace ([`DERIVED_KEY_PREFIX`]).
    Reserved,
}

impl KeySyntaxError {
    /// The sentence a problem's `detail` carries.
    pub fn message(self) -> &'static str {
        match self {
            Self::Empty => "the key is empty",
            Self::TooLong => "the key is longer than 255 characters",
            Self::InvalidCharacter => "the key may only contain visible ASCII characters (0x21-0x7E), no spaces",
            Self::BadEscape => "a quoted key may only escape '\"' and '\\'",
            Self::UnescapedQuote => "a quoted key contains an unescaped '\"'",
            Self::Reserved => {
                "keys starting with `fp:` are the server's own, derived for requests sent without a key; choose another"
            }
        }
    }
}

impl fmt::Display for KeySyntaxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for KeySyntaxError {}

/// Checks a key as it is meant (already unquoted): 1..=255 bytes of 0x21-0x7E.
pub fn validate_key(key: &[u8]) -> Result<(), KeySyntaxError> {
    if key.is_empty() {
        return Err(KeySyntaxError::Empty);
    }
    if key.len() > KEY_MAX_LEN {
        return Err(KeySyntaxError::TooLong);
    }
    if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(KeySyntaxError::InvalidCharacter);
    }
    Ok(())
}

/// Reads the key a header value carries. Only a value that starts *and* ends with `"` is in
/// the RFC 8941 string form; any other value is a plain key, quotes included. A key in the
/// server's namespace ([`DERIVED_KEY_PREFIX`]) is refused: sent with another body it took the
/// derived key of that request for 24 hours (found from outside). [`validate_key`] still
/// takes it, for looking a derived key up.
pub fn parse_key_header(raw: &[u8]) -> Result<String, KeySyntaxError> {
    let key = match raw {
        [b'"', inner @ .., b'"'] => unquote(inner)?,
        _ => raw.to_vec(),
    };
    validate_key(&key)?;
    if key.starts_with(DERIVED_KEY_PREFIX.as_bytes()) {
        return Err(KeySyntaxError::Reserved);
    }
    // Every byte is visible ASCII, so this cannot fail.
    String::from_utf8(key).map_err(|_| KeySyntaxError::InvalidCharacter)
}

/// The header value that [`parse_key_header`] reads back as exactly `key`: a key that
/// starts and ends with `"` would be unquoted, so it is sent quoted (and escaped).
pub fn key_header_value(key: &str) -> String {
    if key.len() >= 2 && key.starts_with('"') && key.ends_with('"') {
        format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
    } else {
        key.to_owned()
    }
}

/// RFC 8941 sf-string body: `\"` and `\\` are the only escapes.
fn unquote(inner: &[u8]) -> Result<Vec<u8>, KeySyntaxError> {
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(KeySyntaxError::BadEscape),
            },
            b'"' => return Err(KeySyntaxError::UnescapedQuote),
            _ => out.push(b),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(raw: &[u8]) -> Result<String, KeySyntaxError> {
        parse_key_header(raw)
    }

    #[test]
    fn plain_and_quoted_keys() {
        assert_eq!(parse(b"abc-123").unwrap(), "abc-123");
        assert_eq!(parse(b"\"abc\"").unwrap(), "abc");
        assert_eq!(parse(br#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
        assert_eq!(parse(&[b'k'; 255]).unwrap().len(), 255);
        // Not the quoted form: a plain key that happens to contain quotes.
        assert_eq!(parse(b"\"abc").unwrap(), "\"abc");
        assert_eq!(parse(b"\"").unwrap(), "\"");
    }

    #[test]
    fn refused_keys_say_why() {
        for (bad, why) in [
            (&b""[..], KeySyntaxError::Empty),
            (b"\"\"", KeySyntaxError::Empty),
            (b"\"a b\"", KeySyntaxError::InvalidCharacter),
            (b"a b", KeySyntaxError::InvalidCharacter),
            (b"\"a\\nb\"", KeySyntaxError::BadEscape),
            (b"\"a\"b\"", KeySyntaxError::UnescapedQuote),
            (b"caf\xc3\xa9", KeySyntaxError::InvalidCharacter),
            (b"a\x01b", KeySyntaxError::InvalidCharacter),
            (b"a\x7fb", KeySyntaxError::InvalidCharacter),
            (&[b'k'; 256], KeySyntaxError::TooLong),
            (b"fp:3a7c", KeySyntaxError::Reserved),
            (b"\"fp:3a7c\"", KeySyntaxError::Reserved),
        ] {
            assert_eq!(parse(bad), Err(why), "{:?}", String::from_utf8_lossy(bad));
        }
        // A derived key is still a key to look up; only a client may not send one.
        assert_eq!(validate_key(b"fp:3a7c"), Ok(()));
        for near in ["FP:3a7c", "fp3a7c", "xfp:3a7c", "fp"] {
            assert_eq!(parse(near.as_bytes()).as_deref(), Ok(near));
        }
    }

    #[test]
    fn every_header_value_reads_back_as_its_key() {
        for key in ["plain", "\"quoted\"", "\"a\\\"b\"", "a\"b", "\"", "\"\""] {
            assert_eq!(
                parse(key_header_value(key).as_bytes()).unwrap(),
                key,
                "sent as {}",
                key_header_value(key)
            );
        }
    }

    proptest! {
        #[test]
        fn visible_ascii_keys_round_trip(key in "[\\x21-\\x7e]{1,255}") {
            prop_assume!(!(key.len() >= 2 && key.starts_with('"') && key.ends_with('"')));
            prop_assume!(!key.starts_with(DERIVED_KEY_PREFIX));
            prop_assert_eq!(parse(key.as_bytes()).unwrap(), key);
        }

        #[test]
        fn header_values_round_trip_every_valid_key(key in "[\\x21-\\x7e]{1,255}") {
            prop_assume!(!key.starts_with(DERIVED_KEY_PREFIX));
            prop_assert_eq!(parse(key_header_value(&key).as_bytes()).unwrap(), key);
        }

        #[test]
        fn quoting_a_key_changes_nothing(key in "[\\x21-\\x7e]{1,200}") {
            prop_assume!(!key.starts_with(DERIVED_KEY_PREFIX));
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            prop_assert_eq!(parse(quoted.as_bytes()).unwrap(), key);
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
            prop_assert!(parse(&key).is_err());
            prop_assert!(validate_key(&key).is_err());
        }

        #[test]
        fn keys_longer_than_255_are_refused(key in "[a-z]{256,400}") {
            prop_assert_eq!(parse(key.as_bytes()), Err(KeySyntaxError::TooLong));
        }

        /// The length rule applies to the unquoted key: 255 escaped characters pass, 256 do not.
        #[test]
        fn quoted_keys_obey_the_length_limit_after_unquoting(key in "[\"\\\\a-z]{250,260}") {
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            prop_assert_eq!(parse(quoted.as_bytes()).is_ok(), key.len() <= KEY_MAX_LEN);
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
            prop_assert!(parse(&key).is_err(), "{:?}", String::from_utf8_lossy(&key));
        }

        /// Whatever the bytes, parsing never panics, and what it accepts keeps the invariant.
        #[test]
        fn any_bytes_parse_to_a_valid_key_or_an_error(raw in prop::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(key) = parse(&raw) {
                prop_assert!((1..=KEY_MAX_LEN).contains(&key.len()));
                prop_assert!(key.bytes().all(|b| (0x21..=0x7e).contains(&b)));
            }
        }
    }
}
