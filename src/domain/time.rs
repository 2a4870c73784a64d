//! Times in answers: RFC 3339 in UTC with `Z` and always six digits of fraction
//! (`2026-12-06T15:04:05.120000Z`), PostgreSQL's precision, as chrono's
//! `to_rfc3339_opts(SecondsFormat::Micros, true)` writes them, written in one piece. One length
//! for every time, so that their texts sort as the times do (chrono's own `Serialize` writes 0,
//! 3, 6 or 9 digits as a time needs: `...:05Z` sorts after `...:05.120Z`).
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

use std::cell::Cell;

use chrono::{DateTime, Datelike, NaiveDate, SecondsFormat, Timelike, Utc};
use serde::{Serialize, Serializer};

/// The form: `9999-12-31T23:59:59.999999Z`.
const MAX_LEN: usize = 27;

/// Serializes `time` with six digits of fraction.
pub fn rfc3339<S: Serializer>(time: &DateTime<Utc>, serializer: S) -> Result<S::Ok, S::Error> {
    let mut buf = [0u8; MAX_LEN];
    match write(time, &mut buf).and_then(|len| std::str::from_utf8(&buf[..len]).ok()) {
        Some(text) => serializer.serialize_str(text),
        None => serializer.serialize_str(&chrono_text(time)),
    }
}

/// chrono's text of the same form, for the times [`write`] leaves to it.
fn chrono_text(time: &DateTime<Utc>) -> String {
    time.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// Serializes `time` as [`rfc3339`] does, `null` for `None`.
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

/// Appends `time` to `out` as a JSON string, as [`rfc3339`] writes it: for answers that
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
        None => serde_json::to_writer(out, &chrono_text(time)).expect("a Vec takes every write"),
    }
}

/// Writes `time` into `buf` and answers its length; `None` for the times left to chrono.
fn write(time: &DateTime<Utc>, buf: &mut [u8; MAX_LEN]) -> Option<usize> {
    // The fields of the naive time: each accessor of a `DateTime` converts to local time
    // again (an offset added, the date recomputed).
    let time = time.naive_utc();
    let nanos = time.nanosecond();
    if nanos >= 1_000_000_000 {
        return None;
    }
    buf[..10].copy_from_slice(&date_text(time.date())?);
    let secs = time.num_seconds_from_midnight();
    buf[10] = b'T';
    put(&mut buf[11..13], secs / 3600);
    buf[13] = b':';
    put(&mut buf[14..16], secs / 60 % 60);
    buf[16] = b':';
    put(&mut buf[17..19], secs % 60);
    // Always microseconds, PostgreSQL's precision: one length, so that the text of two times
    // sorts as the times do ("...:00Z" would sort after "...:00.5Z").
    buf[19] = b'.';
    put(&mut buf[20..26], nanos / 1_000);
    let len = 26;
    buf[len] = b'Z';
    Some(len + 1)
}

/// `date` as `YYYY-MM-DD`; `None` outside the years 0-9999. The rows of a page mostly share
/// their day, and a date's fields cost about a hundred instructions (its month and day are
/// computed from its ordinal each time): the last date written on this thread is kept with
/// its text (`make callgrind`, list phase: with [`put`]'s digit pairs, 317 -> 159 instructions a
/// time written).
fn date_text(date: NaiveDate) -> Option<[u8; 10]> {
    thread_local! {
        static LAST: Cell<Option<(NaiveDate, [u8; 10])>> = const { Cell::new(None) };
    }
    if let Some((last, text)) = LAST.get() {
        if last == date {
            return Some(text);
        }
    }
    let year = u32::try_from(date.year()).ok().filter(|y| *y <= 9999)?;
    let mut text = *b"0000-00-00";
    put(&mut text[..4], year);
    put(&mut text[5..7], date.month());
    put(&mut text[8..10], date.day());
    LAST.set(Some((date, text)));
    Some(text)
}

/// Writes `value`'s last `slot.len()` decimal digits into `slot`: two at a time from the
/// last, from a table of the hundred pairs (a division by the constant 100 is a
/// multiplication), then the odd first one.
fn put(slot: &mut [u8], mut value: u32) {
    const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
                                2021222324252627282930313233343536373839\
                                4041424344454647484950515253545556575859\
                                6061626364656667686970717273747576777879\
                                8081828384858687888990919293949596979899";
    let mut end = slot.len();
    while end >= 2 {
        let pair = (value % 100) as usize * 2;
        slot[end - 2..end].copy_from_slice(&PAIRS[pair..pair + 2]);
        value /= 100;
        end -= 2;
    }
    if end == 1 {
        slot[0] = b'0' + (value % 10) as u8;
    }
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

    /// Ours, and chrono's `to_rfc3339_opts(SecondsFormat::Micros, true)` of the same.
    fn both(at: DateTime<Utc>, maybe: Option<DateTime<Utc>>) -> (String, String) {
        let chrono = serde_json::json!({
            "at": at.to_rfc3339_opts(SecondsFormat::Micros, true),
            "maybe": maybe.map(|m| m.to_rfc3339_opts(SecondsFormat::Micros, true)),
        });
        (serde_json::to_string(&Fast { at, maybe }).unwrap(), chrono.to_string())
    }

    #[test]
    fn each_fraction_and_the_edges_read_as_chrono_writes_them_in_microseconds() {
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
        assert_eq!(fast, r#"{"at":"2025-12-03T22:13:20.000000Z","maybe":null}"#);
        let mut listed = Vec::new();
        append_json(&at, &mut listed);
        assert_eq!(listed, br#""2025-12-03T22:13:20.000000Z""#);
    }

    #[test]
    fn times_of_one_day_and_of_days_taken_in_turn_read_as_chrono_writes_them_in_microseconds() {
        // The kept date must never leak into another day's time.
        let day = 86_400;
        for secs in [
            1_764_800_000,
            1_764_800_001,
            1_764_800_000 + day,
            1_764_800_000,
            1_764_800_000 - day,
            1_764_800_000 - day + 1,
            0,
            -1,
            -day,
            1_764_800_000,
        ] {
            let at = Utc.timestamp_opt(secs, 0).single().unwrap();
            let (fast, chrono) = both(at, Some(at));
            assert_eq!(fast, chrono, "{secs} s");
        }
    }

    proptest! {
        #[test]
        fn any_time_reads_as_chrono_writes_it_in_microseconds(
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
