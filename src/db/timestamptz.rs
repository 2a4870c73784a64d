//! A `timestamptz` column read straight from its binary form, for the queries that read many.
//!
//! sqlx decodes a `DateTime<Utc>` through chrono's calendar arithmetic: PostgreSQL's epoch as
//! a `NaiveDateTime`, plus a `Duration` of the microseconds, then a `FixedOffset` and back to
//! `Utc`; about 400 instructions a value, 6 % of the server's cost of a page of 100 payments
//! (`make callgrind`, the list phase). The value on the wire is the microseconds since
//! 2000-01-01 UTC, a big-endian `i64`: read here as that, and made a `DateTime<Utc>` from the
//! Unix microseconds at once. A property test holds it to the arithmetic sqlx does.
//!
//! Use in a `query!`: `r.created_at AS "created_at: Timestamptz"`, then `.0`.

use chrono::{DateTime, NaiveDate, NaiveDateTime, NaiveTime, Utc};
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgTypeInfo, PgValueFormat, PgValueRef};
use sqlx::{Decode, Postgres, Type};

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01T00:00:00Z).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

/// A `timestamptz` as a `DateTime<Utc>`, decoded from the wire in one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timestamptz(pub DateTime<Utc>);

impl Type<Postgres> for Timestamptz {
    fn type_info() -> PgTypeInfo {
        <DateTime<Utc> as Type<Postgres>>::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        <DateTime<Utc> as Type<Postgres>>::compatible(ty)
    }
}

impl<'r> Decode<'r, Postgres> for Timestamptz {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        if value.format() == PgValueFormat::Text {
            // Only a simple-protocol query answers in text; sqlx's parser reads it.
            return <DateTime<Utc> as Decode<Postgres>>::decode(value).map(Self);
        }
        let bytes: [u8; 8] = value
            .as_bytes()?
            .try_into()
            .map_err(|_| "a timestamptz of other than 8 bytes")?;
        let since_pg_epoch = i64::from_be_bytes(bytes);
        Self::from_wire(since_pg_epoch)
            // `infinity` and `-infinity` (i64::MAX and MIN), which no row of oncepay's holds.
            .ok_or_else(|| format!("a timestamptz out of chrono's range: {since_pg_epoch} µs from 2000").into())
    }
}

impl Timestamptz {
    /// The value whose binary form (`timestamptz_send`) is `since_pg_epoch`; `None` for
    /// `infinity` and `-infinity`, which no row of oncepay's holds.
    pub fn from_wire(since_pg_epoch: i64) -> Option<Self> {
        from_wire(since_pg_epoch).map(Self)
    }
}

/// Many values in a row (a page's column), each as [`Timestamptz::from_wire`] makes it, the
/// last value's date kept: the rows of a page mostly share their day, and the date is the
/// dear part of a value (chrono's `from_num_days_from_ce_opt`, about half of its 120
/// instructions).
#[derive(Debug, Default)]
pub struct WireTimes {
    /// Days since the Unix epoch, and that day's date.
    last: Option<(i64, NaiveDate)>,
}

impl WireTimes {
    /// The instant `since_pg_epoch` microseconds after 2000-01-01T00:00:00Z; `None` for
    /// `infinity`, `-infinity` and what chrono cannot hold.
    pub fn get(&mut self, since_pg_epoch: i64) -> Option<DateTime<Utc>> {
        let micros = since_pg_epoch.checked_add(PG_EPOCH_MICROS)?;
        let secs = micros.div_euclid(1_000_000);
        let nanos = u32::try_from(micros.rem_euclid(1_000_000)).ok()? * 1_000;
        let days = secs.div_euclid(86_400);
        let of_day = u32::try_from(secs.rem_euclid(86_400)).ok()?;
        let date = match self.last {
            Some((last, date)) if last == days => date,
            _ => {
                let date =
                    NaiveDate::from_num_days_from_ce_opt(i32::try_from(days.checked_add(UNIX_EPOCH_DAY_CE)?).ok()?)?;
                self.last = Some((days, date));
                date
            }
        };
        let time = NaiveTime::from_num_seconds_from_midnight_opt(of_day, nanos)?;
        Some(NaiveDateTime::new(date, time).and_utc())
    }
}

/// 1970-01-01 as days of the common era (0001-01-01 is day 1), as chrono counts them.
const UNIX_EPOCH_DAY_CE: i64 = 719_163;

/// The instant `since_pg_epoch` microseconds after 2000-01-01T00:00:00Z.
fn from_wire(since_pg_epoch: i64) -> Option<DateTime<Utc>> {
    since_pg_epoch
        .checked_add(PG_EPOCH_MICROS)
        .and_then(DateTime::from_timestamp_micros)
}

#[cfg(test)]
mod tests {
    use chrono::{Duration, NaiveDate};
    use proptest::prelude::*;

    use super::*;

    /// What sqlx computes for a binary `timestamptz` (sqlx-postgres' `types/chrono/datetime.rs`):
    /// PostgreSQL's epoch plus a `Duration` of the microseconds.
    fn as_sqlx_does(since_pg_epoch: i64) -> DateTime<Utc> {
        let epoch = NaiveDate::from_ymd_opt(2000, 1, 1)
            .unwrap()
            .and_hms_opt(0, 0, 0)
            .unwrap();
        (epoch + Duration::microseconds(since_pg_epoch)).and_utc()
    }

    proptest! {
        /// Every time from year 1 to 9999, to the microsecond, before and after PostgreSQL's
        /// epoch: the same instant as sqlx's decoding.
        #[test]
        fn decodes_what_sqlx_decodes(micros in -63_082_281_600_000_000i64..252_455_615_999_999_999) {
            prop_assert_eq!(from_wire(micros), Some(as_sqlx_does(micros)));
        }
    }

    proptest! {
        /// Values in a row, often of the same day, some a day or years apart: each the same
        /// instant as one read alone.
        #[test]
        fn values_in_a_row_read_as_each_alone(
            start in -63_082_281_600_000_000i64..252_455_615_999_999_999,
            steps in prop::collection::vec(prop_oneof![
                -1_000_000i64..1_000_000,
                -86_400_000_000i64..86_400_000_000,
                -10_000_000_000_000_000i64..10_000_000_000_000_000,
            ], 0..40),
        ) {
            let mut times = WireTimes::default();
            let mut at = start;
            prop_assert_eq!(times.get(at), from_wire(at));
            for step in steps {
                at = at.saturating_add(step);
                prop_assert_eq!(times.get(at), from_wire(at), "{}", at);
            }
        }
    }

    #[test]
    fn the_epochs_and_infinity() {
        let mut times = WireTimes::default();
        for micros in [
            i64::MAX,
            i64::MIN,
            i64::MAX - PG_EPOCH_MICROS,
            0,
            -1,
            1,
            -PG_EPOCH_MICROS,
        ] {
            assert_eq!(times.get(micros), from_wire(micros), "{micros}");
        }
        for micros in [0, -1, 1, -PG_EPOCH_MICROS, 1_000_000 * 86_400 * 365 * 26] {
            assert_eq!(from_wire(micros), Some(as_sqlx_does(micros)), "{micros}");
        }
        assert_eq!(
            from_wire(-PG_EPOCH_MICROS),
            Some(DateTime::<Utc>::UNIX_EPOCH),
            "PostgreSQL's epoch is 30 years after Unix's"
        );
        // PostgreSQL's `infinity` is i64::MAX: none, not a panic or a wrong time.
        assert_eq!(from_wire(i64::MAX), None);
        assert_eq!(from_wire(i64::MIN), None);
    }
}
