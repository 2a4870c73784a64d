//! Times in answers, exactly as chrono's `Serialize` writes them (RFC 3339 in UTC with `Z`,
//! the fraction in 0, 3, 6 or 9 digits as it needs), written in one piece.
//!
//! chrono writes a time to serde_json fragment by fragment (`collect_str`: each of its two-digit
//! fields and separators goes through serde_json's string escaping on its own): about 2,500
//! instructions a time, a fifth of the server's whole cost of a page of 100 payments
//! (`make callgrind`, the list phase). Here the digits go into a buffer on the stack and are
//! escaped once. A time outside the years 0-9999 or in a leap second, which no row of
//! oncepay's holds, is left to chrono; a property test compares the two on random times.
//!
//! Use on a field: `#[serde(serialize_with = "time::rfc3339")]`, or `time::rfc3339_opt` for
//! an `Option`.

use chrono::{DateTime, Datelike, Timelike, Utc};
use serde::{Serialize, Serializer};

/// Longest form: `9999-12-31T23:59:59.999999999Z`.
const MAX_LEN: usize = 30;

/// Serializes `time` as chrono does.
pub fn rfc3339<S: Serializer>(time: &DateTime<Utc>, serializer: S) -> Result<S::Ok, S::Error> {
    let mut buf = [0u8; MAX_LEN];
    match write(time, &mut buf).and_then(|len| std::str::from_utf8(&buf[..len]).ok()) {
        Some(text) => serializer.serialize_str(text),
        None => time.serialize(serializer),
    }
}

/// Serializes `time` as chrono does, `null` for `None`.
pub fn rfc3339_opt<S: Serializer>(time: &Option<DateTime<Utc>>, serializer: S) -> Result<S::Ok, S::Error> {
    struct Present<'a>(&'a DateTime<Utc>);
    impl Serialize for Present<'_> {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            rfc3339(self.0, serializer)
        }
    }
    match time {
        Some(time) => serializer.serialize_some(&Present(time)),
        None => serializer.serialize_none(),
    }
}

/// Appends `time` to `out` as a JSON string, as serde_json writes chrono's: for answers that
/// write their JSON themselves (a list's items).
pub fn append_json(time: &DateTime<Utc>, out: &mut Vec<u8>) {
    let mut buf = [0u8; MAX_LEN];
    match write(time, &mut buf) {
        Some(len) => {
            // Digits and separators: nothing to escape.
            out.push(b'"');
            out.extend_from_slice(&buf[..len]);
            out.push(b'"');
        }
        // chrono writes its form through serde; a `Vec` takes any write.
        None => serde_json::to_writer(out, time).expect("a Vec takes every write, and chrono's Serialize never fails"),
    }
}

/// Writes `time` into `buf` and answers its length; `None` for the times left to chrono.
fn write(time: &DateTime<Utc>, buf: &mut [u8; MAX_LEN]) -> Option<usize> {
    // The fields of the naive time: each accessor of a `DateTime` converts to local time
    // again (an offset added, the date recomputed), about 260 instructions a time in all.
    let time = time.naive_utc();
    let year = u32::try_from(time.year()).ok().filter(|y| *y <= 9999)?;
    let nanos = time.nanosecond();
    if nanos >= 1_000_000_000 {
        return None;
    }
    let mut at = 0;
    let mut put = |mut value: u32, digits: usize| {
        // From the last digit back: a division by the constant 10 is a multiplication.
        for slot in buf[at..at + digits].iter_mut().rev() {
            *slot = b'0' + (value % 10) as u8;
            value /= 10;
        }
        at += digits;
    };
    put(year, 4);
    put(time.month(), 2);
    put(time.day(), 2);
    put(time.hour(), 2);
    put(time.minute(), 2);
    put(time.second(), 2);
    let fraction = match nanos {
        0 => None,
        n if n % 1_000_000 == 0 => Some((n / 1_000_000, 3)),
        n if n % 1_000 == 0 => Some((n / 1_000, 6)),
        n => Some((n, 9)),
    };
    if let Some((value, digits)) = fraction {
        put(value, digits);
    }
    // The digits are in place, 14 of the date and time then the fraction's; spread them out
    // around the separators, from the end.
    let fraction_digits = at - 14;
    let len = 20 + if fraction_digits > 0 { 1 + fraction_digits } else { 0 };
    buf[len - 1] = b'Z';
    if fraction_digits > 0 {
        buf.copy_within(14..14 + fraction_digits, 20);
        buf[19] = b'.';
    }
    for (from, to, separator) in [
        (12, 17, b':'),
        (10, 14, b':'),
        (8, 11, b'T'),
        (6, 8, b'-'),
        (4, 5, b'-'),
    ] {
        buf.copy_within(from..from + 2, to);
        buf[to - 1] = separator;
    }
    // The year stays where it is.
    Some(len)
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use proptest::prelude::*;

    use super::*;

    #[derive(Serialize)]
    struct Fast {
        #[serde(serialize_with = "rfc3339")]
        at: DateTime<Utc>,
        #[serde(serialize_with = "rfc3339_opt")]
        maybe: Option<DateTime<Utc>>,
    }

    #[derive(Serialize)]
    struct Chrono {
        at: DateTime<Utc>,
        maybe: Option<DateTime<Utc>>,
    }

    fn both(at: DateTime<Utc>, maybe: Option<DateTime<Utc>>) -> (String, String) {
        (
            serde_json::to_string(&Fast { at, maybe }).unwrap(),
            serde_json::to_string(&Chrono { at, maybe }).unwrap(),
        )
    }

    #[test]
    fn each_fraction_length_and_the_edges_read_as_chrono_writes_them() {
        for (secs, nanos) in [
            (0, 0),
            (1_764_800_000, 0),
            (1_764_800_000, 120_000_000),
            (1_764_800_000, 123_456_000),
            (1_764_800_000, 123_456_789),
            (1_764_800_000, 1_000),
            (1_764_800_000, 1),
            (-62_167_219_200, 0),           // 0000-01-01
            (253_402_300_799, 999_999_999), // 9999-12-31T23:59:59.999999999
            (253_402_300_800, 0),           // 10000-01-01: chrono's form
            (-62_167_219_201, 0),           // -0001-12-31: chrono's form
            (1_764_800_099, 1_500_000_000), // a leap second: chrono's form
        ] {
            let at = Utc.timestamp_opt(secs, nanos).single().unwrap();
            let (fast, chrono) = both(at, Some(at));
            assert_eq!(fast, chrono, "{secs} s {nanos} ns");
        }
        let at = Utc.timestamp_opt(1_764_800_000, 0).single().unwrap();
        let (fast, chrono) = both(at, None);
        assert_eq!(fast, chrono);
        assert_eq!(fast, r#"{"at":"2025-12-03T22:13:20Z","maybe":null}"#);
    }

    proptest! {
        #[test]
        fn any_time_reads_as_chrono_writes_it(
            secs in -62_167_219_200i64..=253_402_300_799,
            nanos in prop_oneof![Just(0u32), (0u32..1000).prop_map(|m| m * 1_000_000),
                                 (0u32..1_000_000).prop_map(|u| u * 1000), 0u32..1_000_000_000],
        ) {
            let at = Utc.timestamp_opt(secs, nanos).single().unwrap();
            let (fast, chrono) = both(at, Some(at));
            prop_assert_eq!(fast, chrono);
        }
    }
}
