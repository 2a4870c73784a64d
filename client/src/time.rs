//! Times as the server writes them (docs/api.md, conventions): RFC 3339 in UTC with `Z` and
//! always six digits of fraction, so that the CLI's lines carry the server's text and their
//! times sort as text. chrono's own `Serialize` writes 0, 3, 6 or 9 digits as a time needs.
//!
//! Use on a field: `#[serde(serialize_with = "crate::time::rfc3339")]`, or
//! `crate::time::rfc3339_opt` for an `Option`.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serializer;

/// Serializes `time` with six digits of fraction.
pub fn rfc3339<S: Serializer>(time: &DateTime<Utc>, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&time.to_rfc3339_opts(SecondsFormat::Micros, true))
}

/// Serializes `time` as [`rfc3339`] does, `null` for `None`.
pub fn rfc3339_opt<S: Serializer>(time: &Option<DateTime<Utc>>, serializer: S) -> Result<S::Ok, S::Error> {
    match time {
        Some(time) => rfc3339(time, serializer),
        None => serializer.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use serde::Serialize;

    use super::*;

    #[derive(Serialize)]
    struct Times {
        #[serde(serialize_with = "rfc3339")]
        at: DateTime<Utc>,
        #[serde(serialize_with = "rfc3339_opt")]
        maybe: Option<DateTime<Utc>>,
        #[serde(serialize_with = "rfc3339_opt")]
        none: Option<DateTime<Utc>>,
    }

    #[test]
    fn every_time_has_six_digits_of_fraction() {
        let whole = Utc.timestamp_opt(1_764_800_000, 0).single().unwrap();
        let half = Utc.timestamp_opt(1_764_800_000, 500_000_000).single().unwrap();
        let json = serde_json::to_string(&Times {
            at: whole,
            maybe: Some(half),
            none: None,
        })
        .unwrap();
        assert_eq!(
            json,
            r#"{"at":"2025-12-03T22:13:20.000000Z","maybe":"2025-12-03T22:13:20.500000Z","none":null}"#
        );
    }
}
