//! A page read as one row of columns: each column of the page's rows aggregated by
//! PostgreSQL into one value, taken apart here.
//!
//! Why: a page of 100 payments sent as 101 rows costs the server more than the rest of the
//! request together. sqlx hands each row through two nested streams (a lock and a re-poll
//! of the whole future stack a row) and builds a `PgRow` for it: 309k of the 470k
//! instructions of a page (`make callgrind`), while PostgreSQL sends the same rows for 62 µs.
//! Aggregated, the page is one row of six values: measured over the lab's database
//! (`/work/lab/drv`, a client reading the first page 15,000 times, CPU from `/proc`, two
//! runs), the client's CPU a page 73 -> 28-32 µs against PostgreSQL's 61-63 -> 75-77 µs. Other
//! shapes measured, each dearer for PostgreSQL: one `string_agg` of each row's fields
//! concatenated (80-82 µs), `string_agg(record_send(r))` (86-95), `array_agg` of the rows
//! (164-192) or of each column (docs/bench/README.md, "Results of 2026-12-05 13:49").
//!
//! The shape, for `n` rows: a fixed-width column is `string_agg(<type>send(c), ''::bytea)`,
//! the values' binary forms back to back (`uuid_send` 16 bytes, `int8send` and
//! `timestamptz_send` 8); a nullable one writes a byte before each value, `\x00` for NULL
//! (then nothing) or `\x01`; a text column is `string_agg(c, '')` beside
//! `string_agg(int4send(length(c)), ''::bytea)`, the lengths in characters, which no
//! client encoding changes. The aggregates of one `SELECT` consume the same rows in the same
//! order, so the i-th value of each column is the i-th row's; the reading order itself is
//! not promised to an aggregate, so the caller sorts the rows it builds. Every column is
//! checked against `n`: a page whose columns disagree is an error, never a row made of two.

use std::error::Error as StdError;

use chrono::{DateTime, Utc};

use crate::db::WireTimes;

/// A page's columns that do not fit together.
fn mismatch(what: &str) -> sqlx::Error {
    let err: Box<dyn StdError + Send + Sync> = format!("a list page's columns disagree: {what}").into();
    sqlx::Error::Decode(err)
}

/// Rows in a page whose fixed-width column of `width` bytes is `column`.
pub(super) fn rows(column: &[u8], width: usize) -> Result<usize, sqlx::Error> {
    if column.len().is_multiple_of(width) {
        Ok(column.len() / width)
    } else {
        Err(mismatch("a fixed-width column's length"))
    }
}

/// The `n` values of `N` bytes of a fixed-width column.
pub(super) fn fixed<const N: usize>(
    column: &[u8],
    n: usize,
) -> Result<impl Iterator<Item = [u8; N]> + '_, sqlx::Error> {
    if column.len() != n * N {
        return Err(mismatch("a fixed-width column's length"));
    }
    Ok(column
        .chunks_exact(N)
        .map(|chunk| chunk.try_into().expect("chunks of N")))
}

/// The `n` values of an `int8` column.
pub(super) fn int8s(column: &[u8], n: usize) -> Result<impl Iterator<Item = i64> + '_, sqlx::Error> {
    Ok(fixed::<8>(column, n)?.map(i64::from_be_bytes))
}

/// The `n` values of a `uuid` column.
pub(super) fn uuids(column: &[u8], n: usize) -> Result<impl Iterator<Item = uuid::Uuid> + '_, sqlx::Error> {
    Ok(fixed::<16>(column, n)?.map(uuid::Uuid::from_bytes))
}

/// The `n` values of a `timestamptz` column.
pub(super) fn times(column: &[u8], n: usize) -> Result<Vec<DateTime<Utc>>, sqlx::Error> {
    // Pushed into room for all: collected through a `Result` the vector knew no size and grew
    // seven times over (`make callgrind`, list phase, with [`WireTimes`]' kept date: 205 -> 98
    // instructions a value).
    let mut values = Vec::with_capacity(n);
    let mut times = WireTimes::default();
    for wire in fixed::<8>(column, n)? {
        values.push(time(&mut times, wire)?);
    }
    Ok(values)
}

/// The `n` values of a nullable `timestamptz` column (a byte before each value: 0, NULL).
pub(super) fn optional_times(column: &[u8], n: usize) -> Result<Vec<Option<DateTime<Utc>>>, sqlx::Error> {
    let mut values = Vec::with_capacity(n);
    let mut times = WireTimes::default();
    let mut rest = column;
    while let Some((&marker, after)) = rest.split_first() {
        rest = after;
        match marker {
            0 => values.push(None),
            1 => {
                let (value, after) = rest
                    .split_first_chunk::<8>()
                    .ok_or_else(|| mismatch("a nullable column's value cut short"))?;
                values.push(Some(time(&mut times, *value)?));
                rest = after;
            }
            _ => return Err(mismatch("a nullable column's marker")),
        }
    }
    if values.len() == n {
        Ok(values)
    } else {
        Err(mismatch("a nullable column's count"))
    }
}

/// The `n` values of a text column: `joined` cut at `lengths`, in characters.
pub(super) fn texts<'a>(lengths: &[u8], joined: &'a str, n: usize) -> Result<Vec<&'a str>, sqlx::Error> {
    let mut values = Vec::with_capacity(n);
    let mut rest = joined;
    for length in fixed::<4>(lengths, n)?.map(i32::from_be_bytes) {
        let chars = usize::try_from(length).map_err(|_| mismatch("a negative length"))?;
        let (value, after) = if rest.len() >= chars && rest.as_bytes()[..chars].is_ascii() {
            // A byte a character (an account id always: its domain is ASCII).
            rest.split_at(chars)
        } else {
            let end = rest.char_indices().nth(chars).map_or(rest.len(), |(at, _)| at);
            let (value, after) = rest.split_at(end);
            if value.chars().count() != chars {
                return Err(mismatch("a text column shorter than its lengths"));
            }
            (value, after)
        };
        values.push(value);
        rest = after;
    }
    if rest.is_empty() {
        Ok(values)
    } else {
        Err(mismatch("a text column longer than its lengths"))
    }
}

fn time(times: &mut WireTimes, wire: [u8; 8]) -> Result<DateTime<Utc>, sqlx::Error> {
    times
        .get(i64::from_be_bytes(wire))
        .ok_or_else(|| mismatch("a timestamptz out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_are_cut_at_character_lengths() {
        let lengths: Vec<u8> = [3, 0, 2, 1].iter().flat_map(|n: &i32| n.to_be_bytes()).collect();
        assert_eq!(texts(&lengths, "abcé𝄞z", 4).unwrap(), ["abc", "", "é𝄞", "z"]);
        // A count or a length that does not fit is an error, not a guess.
        assert!(texts(&lengths, "abcé𝄞z", 3).is_err());
        assert!(texts(&lengths, "abcé𝄞", 4).is_err());
        assert!(texts(&lengths, "abcé𝄞zz", 4).is_err());
        let negative: Vec<u8> = (-1i32).to_be_bytes().to_vec();
        assert!(texts(&negative, "", 1).is_err());
    }

    #[test]
    fn nullable_values_carry_a_marker() {
        let at = 86_400_000_000i64.to_be_bytes();
        let column: Vec<u8> = [&[0u8][..], &[1], &at, &[0]].concat();
        let values = optional_times(&column, 3).unwrap();
        assert_eq!(values[0], None);
        assert_eq!(values[1].unwrap().to_rfc3339(), "2000-01-02T00:00:00+00:00");
        assert_eq!(values[2], None);
        assert!(optional_times(&column, 2).is_err());
        assert!(optional_times(&column[..5], 2).is_err(), "a value cut short");
        assert!(optional_times(&[2], 1).is_err(), "an unknown marker");
    }

    #[test]
    fn fixed_width_columns_are_held_to_their_count() {
        let column: Vec<u8> = [7i64, -1].iter().flat_map(|n| n.to_be_bytes()).collect();
        assert_eq!(int8s(&column, 2).unwrap().collect::<Vec<_>>(), [7, -1]);
        assert!(int8s(&column, 3).is_err());
        assert_eq!(rows(&column, 16).unwrap(), 1);
        assert!(rows(&column[..15], 16).is_err());
    }
}
