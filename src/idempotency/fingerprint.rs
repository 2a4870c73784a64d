//! The request fingerprint (docs/api.md, Idempotency, rule 3): SHA-256 over the method, the path
//! and the canonical JSON of the body, so that bodies equal as JSON values fingerprint alike.

use serde_json::Value;
use sha2::{Digest, Sha256};

pub type Fingerprint = [u8; 32];

pub fn fingerprint(method: &str, path: &str, body: &Value) -> Fingerprint {
    let mut canonical = String::with_capacity(64);
    write_canonical(body, &mut canonical);
    let mut hasher = Sha256::new();
    hasher.update(method.as_bytes());
    hasher.update(b"\n");
    hasher.update(path.as_bytes());
    hasher.update(b"\n");
    hasher.update(canonical.as_bytes());
    hasher.finalize().into()
}

/// Object keys sorted (by their UTF-8 bytes) at every depth, no insignificant white space.
/// The sort is explicit rather than left to `serde_json::Map`'s order, which a dependency
/// turning on `preserve_order` would silently change.
pub fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (i, (key, value)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                write_canonical(value, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn canonical(value: &Value) -> String {
        let mut out = String::new();
        write_canonical(value, &mut out);
        out
    }

    #[test]
    fn keys_are_sorted_at_every_depth() {
        let value: Value = serde_json::from_str(r#"{ "b": {"z": 1, "a": [ {"y":2,"x":1} ]}, "a": "\u0041" }"#).unwrap();
        assert_eq!(canonical(&value), r#"{"a":"A","b":{"a":[{"x":1,"y":2}],"z":1}}"#);
    }

    #[test]
    fn method_and_path_are_part_of_it() {
        let body = json!({"amount": 100});
        assert_ne!(
            fingerprint("POST", "/payments", &body),
            fingerprint("POST", "/accounts", &body)
        );
        assert_ne!(
            fingerprint("POST", "/payments", &body),
            fingerprint("PUT", "/payments", &body)
        );
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<u64>().prop_map(|n| json!(n)),
            any::<f64>()
                .prop_filter("JSON numbers are finite", |f| f.is_finite())
                .prop_map(|f| json!(f)),
            "[a-zA-Z0-9 é\"\\\\\u{0}-\u{1f}\u{2028}😀]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(6, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::btree_map("[a-dé😀\"]{1,3}", inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// A string with every character written as a `\uXXXX` escape (surrogate pairs beyond
    /// the BMP).
    fn escaped(text: &str) -> String {
        let mut out = String::from("\"");
        for unit in text.encode_utf16() {
            out.push_str(&format!("\\u{unit:04X}"));
        }
        out.push('"');
        out
    }

    /// Writes a value with object keys in reverse order, extra white space, strings and keys
    /// fully escaped and floats in exponent form: the same JSON value in another spelling.
    fn respell(value: &Value) -> String {
        match value {
            Value::Object(map) => {
                let parts: Vec<String> = map
                    .iter()
                    .rev()
                    .map(|(k, v)| format!(" {} :\n {} ", escaped(k), respell(v)))
                    .collect();
                format!("{{ {} }}", parts.join(" , "))
            }
            Value::Array(items) => {
                format!("[ {} ]", items.iter().map(respell).collect::<Vec<_>>().join(" ,\t"))
            }
            Value::String(text) => escaped(text),
            Value::Number(n) if n.is_f64() => format!("{:e}", n.as_f64().unwrap()),
            scalar => scalar.to_string(),
        }
    }

    proptest! {
        #[test]
        fn equal_json_values_have_equal_fingerprints(value in json_value()) {
            let reparsed: Value = serde_json::from_str(&respell(&value)).unwrap();
            prop_assert_eq!(fingerprint("POST", "/payments", &value), fingerprint("POST", "/payments", &reparsed));
        }

        #[test]
        fn different_json_values_have_different_fingerprints(a in json_value(), b in json_value()) {
            prop_assume!(a != b);
            prop_assert_ne!(fingerprint("POST", "/payments", &a), fingerprint("POST", "/payments", &b));
        }

        #[test]
        fn canonical_form_parses_back_to_the_same_value(value in json_value()) {
            let back: Value = serde_json::from_str(&canonical(&value)).unwrap();
            prop_assert_eq!(back, value);
        }
    }
}
