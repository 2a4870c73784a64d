//! [`Throttle`]: a log line that would repeat with every request or every round of a worker
//! (a database away, a replica that cannot sign) written at most once an interval, with the
//! number held back since, so that an outage reads as a few lines, not thousands.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Lets a repeated log line through at most once an interval, counting the ones held back.
/// `const`, so that a module can keep one in a `static`.
pub struct Throttle {
    every: Duration,
    /// When a line last went out, and how many were held back since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    pub const fn new(every: Duration) -> Self {
        Self {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(held back since the last line)` when a line may go out at `now`, else `None`
    /// (and this one is counted).
    pub fn admit(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (last, held) = &mut *state;
        if last.is_some_and(|at| now.saturating_duration_since(at) < self.every) {
            *held += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttled_line_goes_out_once_an_interval_with_the_count_held_back() {
        let throttle = Throttle::new(Duration::from_secs(60));
        let start = Instant::now();
        assert_eq!(throttle.admit(start), Some(0));
        for s in [0, 1, 30, 59] {
            assert_eq!(throttle.admit(start + Duration::from_secs(s)), None);
        }
        assert_eq!(throttle.admit(start + Duration::from_secs(60)), Some(4));
        assert_eq!(throttle.admit(start + Duration::from_secs(61)), None);
        assert_eq!(throttle.admit(start + Duration::from_secs(200)), Some(1));
        // A clock read before the last line (another thread's) is held back, not a panic.
        assert_eq!(throttle.admit(start), None);
    }
}
