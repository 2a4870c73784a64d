//! Values parsed at the edge: past it, an `Amount` or an `AccountId` is valid by type.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

/// The largest amount or balance the API accepts, in minor units.
pub const MAX_AMOUNT: i64 = 1_000_000_000_000;

/// A positive amount in minor units, 1 ..= 10^12.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Amount(i64);

impl Amount {
    pub fn new(minor_units: i64) -> Result<Self, String> {
        in_range(minor_units, 1).map(Self)
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

/// A balance given at account or tenant creation, 0 ..= 10^12.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct OpeningBalance(i64);

impl OpeningBalance {
    pub fn new(minor_units: i64) -> Result<Self, String> {
        in_range(minor_units, 0).map(Self)
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

fn in_range(n: i64, min: i64) -> Result<i64, String> {
    if (min..=MAX_AMOUNT).contains(&n) {
        Ok(n)
    } else {
        Err(format!("must be between {min} and {MAX_AMOUNT}"))
    }
}

/// Reads a JSON integer in minor units. The strict parser keeps `100` an integer and `100.0`
/// or `1e2` a float, so a float here was written with a fraction or an exponent: refused.
struct MinorUnits {
    min: i64,
}

impl Visitor<'_> for MinorUnits {
    type Value = i64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "an integer in minor units (no fraction or exponent), between {} and {MAX_AMOUNT}",
            self.min
        )
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<i64, E> {
        in_range(n, self.min).map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<i64, E> {
        self.visit_i64(i64::try_from(n).unwrap_or(i64::MAX))
    }

    /// The parser hands over as a float, besides numbers with a fraction or an exponent, the
    /// integers no `i64` holds (2^64 and beyond) and `-0`: those are told what is wrong with
    /// their value, which holds however they were written.
    fn visit_f64<E: de::Error>(self, n: f64) -> Result<i64, E> {
        let min = self.min;
        let detail = if n == 0.0 && n.is_sign_negative() {
            format!("must be between {min} and {MAX_AMOUNT}, written without a sign, fraction or exponent (not -0)")
        } else if n.is_finite() && n.fract() == 0.0 && !(min as f64..=MAX_AMOUNT as f64).contains(&n) {
            format!("must be between {min} and {MAX_AMOUNT}")
        } else {
            format!("must be an integer in minor units (no fraction or exponent), between {min} and {MAX_AMOUNT}")
        };
        Err(E::custom(detail))
    }
}

impl<'de> Deserialize<'de> for Amount {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_i64(MinorUnits { min: 1 }).map(Self)
    }
}

impl<'de> Deserialize<'de> for OpeningBalance {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_i64(MinorUnits { min: 0 }).map(Self)
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

/// How a tenant's keyless POSTs are treated (docs/api.md, Idempotency, rule 10).
// Read from JSON as one of its three strings only (serde's derive also took `{"allow": null}`,
// found from outside): `Deserialize` below.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum MissingKeyPolicy {
    Reject,
    Allow,
    Fingerprint,
}

impl MissingKeyPolicy {
    /// What a value that is none of the three is told.
    const ONE_OF: &'static str = "must be one of \"reject\", \"allow\", \"fingerprint\"";

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
            _ => Err(format!("`missing_key_policy` {}", Self::ONE_OF)),
        }
    }
}

impl<'de> Deserialize<'de> for MissingKeyPolicy {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer).map_err(|_| de::Error::custom(Self::ONE_OF))?;
        Self::parse(&raw).map_err(|_| de::Error::custom(Self::ONE_OF))
    }
}

impl<'de> Deserialize<'de> for AccountId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        Self::parse(&raw).map_err(de::Error::custom)
    }
}

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
    use serde_json::{json, Value};

    #[test]
    fn amounts_must_be_plain_integers_in_range() {
        assert_eq!(Amount::deserialize(&json!(1)).unwrap().get(), 1);
        assert_eq!(Amount::deserialize(&json!(MAX_AMOUNT)).unwrap().get(), MAX_AMOUNT);
        for bad in [
            json!(0),
            json!(-5),
            json!(MAX_AMOUNT + 1),
            json!(1.5),
            json!("100"),
            json!(null),
        ] {
            assert!(Amount::deserialize(&bad).is_err(), "{bad} accepted");
        }
        let float: Value = serde_json::from_str("100.0").unwrap();
        let exponent: Value = serde_json::from_str("1e2").unwrap();
        assert!(Amount::deserialize(&float).is_err());
        assert!(Amount::deserialize(&exponent).is_err());
        assert_eq!(OpeningBalance::deserialize(&json!(0)).unwrap().get(), 0);
    }

    /// `-0` and integers past `u64` reach the visitor as floats; what they are told must be
    /// about their value, not a fraction or an exponent they were not written with.
    #[test]
    fn integers_read_as_floats_are_told_what_is_wrong_with_them() {
        let detail = |text: &str| {
            let value: Value = serde_json::from_str(text).unwrap();
            Amount::deserialize(&value).unwrap_err().to_string()
        };
        assert_eq!(
            detail("18446744073709551616"),
            format!("must be between 1 and {MAX_AMOUNT}")
        );
        assert_eq!(
            detail("-18446744073709551616"),
            format!("must be between 1 and {MAX_AMOUNT}")
        );
        assert!(detail("-0").contains("not -0"), "{}", detail("-0"));
        let opening: Value = serde_json::from_str("-0").unwrap();
        assert!(OpeningBalance::deserialize(&opening)
            .unwrap_err()
            .to_string()
            .contains("not -0"));
        for spelled in ["100.0", "1e2", "1.5", "-0.5"] {
            assert!(
                detail(spelled).contains("no fraction or exponent"),
                "{spelled}: {}",
                detail(spelled)
            );
        }
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
            prop_assert_eq!(Amount::deserialize(&json!(n)).unwrap().get(), n);
        }

        /// Only the plain integer spelling is an amount: the same number with a fraction, an
        /// exponent or in quotes is refused, as docs/api.md, Conventions, says.
        #[test]
        fn only_the_plain_spelling_of_an_amount_is_accepted(n in 1i64..=MAX_AMOUNT) {
            let plain: Value = serde_json::from_str(&n.to_string()).unwrap();
            prop_assert_eq!(Amount::deserialize(&plain).unwrap().get(), n);
            for spelling in [format!("{n}.0"), format!("{n}e0"), format!("{n}0e-1"), format!("{n}.000"), format!("\"{n}\"")] {
                let value: Value = serde_json::from_str(&spelling).unwrap();
                prop_assert!(Amount::deserialize(&value).is_err(), "{} accepted", spelling);
                prop_assert!(OpeningBalance::deserialize(&value).is_err(), "{} accepted", spelling);
            }
        }

        #[test]
        fn integers_out_of_range_are_refused(n in prop_oneof![i64::MIN..=0i64, (MAX_AMOUNT + 1)..=i64::MAX]) {
            prop_assert!(Amount::deserialize(&json!(n)).is_err());
        }
    }
}
