//! Request bodies are parsed strictly: an object that names a field twice is invalid JSON.
//!
//! RFC 8259 leaves duplicate names to the parser, and parsers disagree (first wins, last
//! wins, error): `{"amount": 1, "amount": 1000}` could be read as 1 by a gateway that
//! logged or approved it and as 1000 here. A payment API refuses the ambiguity (400
//! `invalid_json`) instead of picking a side. `serde_json::Value` keeps the last value
//! silently, so this visitor builds the same `Value` and stops at a repeated name.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// Parses `bytes` as one JSON value, refusing objects with a repeated field name.
pub fn parse_strict(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    serde_json::from_slice::<Strict>(bytes).map(|s| s.0)
}

struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(StrictVisitor)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Strict;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Strict, E> {
        Ok(Strict(Value::Bool(v)))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Strict, E> {
        // JSON text has no NaN or infinity, so `from` never yields `Null` here.
        Ok(Strict(v.into()))
    }

    fn visit_str<E>(self, v: &str) -> Result<Strict, E> {
        Ok(Strict(Value::String(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Strict, E> {
        Ok(Strict(Value::String(v)))
    }

    fn visit_unit<E>(self) -> Result<Strict, E> {
        Ok(Strict(Value::Null))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(Strict(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Strict(Value::Array(items)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Strict, A::Error> {
        let mut object = Map::new();
        while let Some(name) = map.next_key::<String>()? {
            if object.contains_key(&name) {
                return Err(de::Error::custom(format_args!("the field `{name}` appears twice")));
            }
            let Strict(value) = map.next_value()?;
            object.insert(name, value);
        }
        Ok(Strict(Value::Object(object)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_repeated_name_is_refused_at_any_depth() {
        assert!(parse_strict(br#"{"amount": 1, "amount": 1000}"#).is_err());
        assert!(parse_strict(br#"{"a": [{"x": 1, "x": 1}]}"#).is_err());
        // The same name in sibling objects is no repetition.
        assert!(parse_strict(br#"[{"x": 1}, {"x": 2}]"#).is_ok());
        // Names are compared after unescaping: "\u0061" is "a".
        assert!(parse_strict(br#"{"a": 1, "\u0061": 2}"#).is_err());
    }

    #[test]
    fn malformed_json_is_still_an_error() {
        for bad in [&b"{"[..], b"", b"{\"a\":1,}", b"nope", b"1 2"] {
            assert!(parse_strict(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-1e12f64..1e12).prop_map(Value::from),
            "[a-z \"\\\\é]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::btree_map("[a-d]{1,3}", inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn documents_without_repeated_names_parse_exactly_as_serde_json_does(value in json_value()) {
            let text = serde_json::to_vec(&value).unwrap();
            let expected: Value = serde_json::from_slice(&text).unwrap();
            prop_assert_eq!(parse_strict(&text).unwrap(), expected);
        }
    }
}
