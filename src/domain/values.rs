//! Values parsed at the edge: past it, an `Amount` or an `AccountId` is valid by type.

use serde_json::Value;

/// The largest amount or balance the API accepts, in minor units.
pub const MAX_AMOUNT: i64 = 1_000_000_000_000;

/// A positive amount in minor units, 1 ..= 10^12.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Amount(i64);

impl Amount {
    /// Parses a JSON value: an integer (no fraction, no exponent) within 1 ..= 10^12.
    pub fn parse(field: &str, value: &Value) -> Result<Self, String> {
        parse_integer(field, value, 1).map(Self)
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

/// A balance given at account or tenant creation, 0 ..= 10^12.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct OpeningBalance(i64);

impl OpeningBalance {
    pub fn parse(field: &str, value: &Value) -> Result<Self, String> {
        parse_integer(field, value, 0).map(Self)
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

fn parse_integer(field: &str, value: &Value, min: i64) -> Result<i64, String> {
    // serde_json keeps `100` as an integer and `100.0` or `1e2` as a float, so a number that
    // is not an i64 here was written with a fraction, an exponent, or is out of range.
    match value.as_i64() {
        Some(n) if (min..=MAX_AMOUNT).contains(&n) => Ok(n),
        Some(_) => Err(format!("`{field}` must be between {min} and {MAX_AMOUNT}")),
        None if value.is_number() => Err(format!(
            "`{field}` must be an integer in minor units (no fraction or exponent), between {min} and {MAX_AMOUNT}"
        )),
        None => Err(format!("`{field}` must be an integer")),
    }
}

/// An account id: 1..=64 characters of `[A-Za-z0-9_.:-]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccountId(String);

impl AccountId {
    pub const MAIN: &'static str = "main";

    pub fn parse(raw: &str) -> Result<Self, String> {
        let valid = (1..=64).contains(&raw.len())
            && raw
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'));
        if valid {
            Ok(Self(raw.to_owned()))
        } else {
            Err("an account id is 1 to 64 characters of A-Z, a-z, 0-9, '_', '.', ':' or '-'".to_owned())
        }
    }

    /// The account every tenant gets at creation, and the default of a payment.
    pub fn main() -> Self {
        Self(Self::MAIN.to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// How a tenant's keyless POSTs are treated (contract section 5, rule 10).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum MissingKeyPolicy {
    Reject,
    Allow,
    Fingerprint,
}

impl MissingKeyPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reject => "reject",
            Self::Allow => "allow",
            Self::Fingerprint => "fingerprint",
        }
    }

    pub fn parse(raw: &str) -> Result<Self, String> {
        match raw {
            "reject" => Ok(Self::Reject),
            "allow" => Ok(Self::Allow),
            "fingerprint" => Ok(Self::Fingerprint),
            _ => Err("`missing_key_policy` must be one of \"reject\", \"allow\", \"fingerprint\"".to_owned()),
        }
    }
}

/// Deserialises through a JSON value, so that a body's fields are checked by the same
/// parsers as everywhere else and a bad value is named in serde's error with its field.
macro_rules! deserialize_via_value {
    ($ty:ty, $parse:expr) => {
        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let value = Value::deserialize(deserializer)?;
                $parse(&value).map_err(serde::de::Error::custom)
            }
        }
    };
}

deserialize_via_value!(Amount, |v: &Value| Amount::parse("amount", v));
deserialize_via_value!(OpeningBalance, |v: &Value| OpeningBalance::parse("balance", v));
deserialize_via_value!(AccountId, |v: &Value| match v {
    Value::String(s) => AccountId::parse(s),
    _ => Err("an account id must be a string".to_owned()),
});

impl serde::Serialize for AccountId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl std::fmt::Display for AccountId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn amounts_must_be_plain_integers_in_range() {
        assert_eq!(Amount::parse("amount", &json!(1)).unwrap().get(), 1);
        assert_eq!(Amount::parse("amount", &json!(MAX_AMOUNT)).unwrap().get(), MAX_AMOUNT);
        for bad in [
            json!(0),
            json!(-5),
            json!(MAX_AMOUNT + 1),
            json!(1.5),
            json!("100"),
            json!(null),
        ] {
            assert!(Amount::parse("amount", &bad).is_err(), "{bad} accepted");
        }
        let float: Value = serde_json::from_str("100.0").unwrap();
        let exponent: Value = serde_json::from_str("1e2").unwrap();
        assert!(Amount::parse("amount", &float).is_err());
        assert!(Amount::parse("amount", &exponent).is_err());
        assert_eq!(OpeningBalance::parse("balance", &json!(0)).unwrap().get(), 0);
    }

    proptest! {
        #[test]
        fn account_ids_accept_exactly_the_documented_alphabet(id in "[A-Za-z0-9_.:-]{1,64}") {
            prop_assert!(AccountId::parse(&id).is_ok());
        }

        #[test]
        fn account_ids_refuse_other_characters(prefix in "[a-z]{0,10}", bad in "[^A-Za-z0-9_.:-]", suffix in "[a-z]{0,10}") {
            let id = format!("{prefix}{bad}{suffix}");
            prop_assert!(AccountId::parse(&id).is_err());
        }

        #[test]
        fn account_ids_longer_than_64_are_refused(id in "[a-z]{65,100}") {
            prop_assert!(AccountId::parse(&id).is_err());
        }

        #[test]
        fn every_integer_in_range_is_an_amount(n in 1i64..=MAX_AMOUNT) {
            prop_assert_eq!(Amount::parse("amount", &json!(n)).unwrap().get(), n);
        }

        /// Only the plain integer spelling is an amount: the same number with a fraction, an
        /// exponent or in quotes is refused, as the contract says.
        #[test]
        fn only_the_plain_spelling_of_an_amount_is_accepted(n in 1i64..=MAX_AMOUNT) {
            let plain: Value = serde_json::from_str(&n.to_string()).unwrap();
            prop_assert_eq!(Amount::parse("amount", &plain).unwrap().get(), n);
            for spelling in [format!("{n}.0"), format!("{n}e0"), format!("{n}0e-1"), format!("{n}.000"), format!("\"{n}\"")] {
                let value: Value = serde_json::from_str(&spelling).unwrap();
                prop_assert!(Amount::parse("amount", &value).is_err(), "{} accepted", spelling);
                prop_assert!(OpeningBalance::parse("balance", &value).is_err(), "{} accepted", spelling);
            }
        }

        #[test]
        fn integers_out_of_range_are_refused(n in prop_oneof![i64::MIN..=0i64, (MAX_AMOUNT + 1)..=i64::MAX]) {
            prop_assert!(Amount::parse("amount", &json!(n)).is_err());
        }
    }
}
