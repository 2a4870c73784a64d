//! The retry budget: a token bucket shared by the operations of one client.
//!
//! A retry *reserves* the next token: when the bucket is empty the balance goes negative
//! and the retry waits until its token has been refilled. Reservations are served in the
//! order they were made, one every `1 / refill_per_sec` seconds, so the retries of many
//! failing operations come out evenly spread, never in a burst.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::BudgetConfig;

#[derive(Debug)]
pub struct RetryBudget {
    config: BudgetConfig,
    bucket: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    /// Tokens at `updated`; negative while retries wait for refilled tokens.
    tokens: f64,
    updated: Instant,
}

impl RetryBudget {
    /// A full bucket. `capacity` below 1 or a non-positive refill rate would make every
    /// retry impossible; they are raised to one token and one token per hour.
    pub fn new(config: BudgetConfig) -> Self {
        let config = BudgetConfig {
            capacity: config.capacity.max(1.0),
            refill_per_sec: config.refill_per_sec.max(1.0 / 3_600.0),
        };
        Self {
            bucket: Mutex::new(Bucket {
                tokens: config.capacity,
                updated: Instant::now(),
            }),
            config,
        }
    }

    /// Reserves one token for a retry that may not be sent after `latest`. Returns how long
    /// to wait for the token, or `None` (and reserves nothing) when it would come too late.
    pub fn reserve(&self, latest: Instant) -> Option<Duration> {
        let now = Instant::now();
        // A poisoned lock only means another thread panicked mid-update of two plain numbers.
        let mut bucket = self.bucket.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let refilled = now.saturating_duration_since(bucket.updated).as_secs_f64() * self.config.refill_per_sec;
        bucket.tokens = (bucket.tokens + refilled).min(self.config.capacity);
        bucket.updated = now;
        let wait = if bucket.tokens >= 1.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((1.0 - bucket.tokens) / self.config.refill_per_sec)
        };
        if now + wait > latest {
            return None;
        }
        bucket.tokens -= 1.0;
        Some(wait)
    }

    /// Tokens available now (negative: retries are queued for refilled tokens).
    #[cfg(test)]
    fn available(&self) -> f64 {
        let bucket = self.bucket.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let refilled = bucket.updated.elapsed().as_secs_f64() * self.config.refill_per_sec;
        (bucket.tokens + refilled).min(self.config.capacity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(capacity: f64, refill_per_sec: f64) -> RetryBudget {
        RetryBudget::new(BudgetConfig {
            capacity,
            refill_per_sec,
        })
    }

    #[test]
    fn a_full_bucket_grants_its_capacity_without_waiting_then_spaces_reservations() {
        let budget = budget(3.0, 10.0);
        let far = Instant::now() + Duration::from_secs(60);
        let waits: Vec<Duration> = (0..6).map(|_| budget.reserve(far).unwrap()).collect();

        assert!(waits[..3].iter().all(Duration::is_zero), "{waits:?}");
        // Then one token per 100 ms, each reservation behind the previous one.
        for (i, wait) in waits[3..].iter().enumerate() {
            let expected = 0.1 * (i + 1) as f64;
            assert!((wait.as_secs_f64() - expected).abs() < 0.02, "{waits:?}");
        }
    }

    #[test]
    fn a_token_that_would_come_after_the_deadline_is_refused_and_not_taken() {
        let budget = budget(1.0, 1.0);
        let soon = Instant::now() + Duration::from_millis(200);
        assert_eq!(budget.reserve(soon), Some(Duration::ZERO));

        assert_eq!(budget.reserve(soon), None, "the next token is a second away");
        assert!(
            budget.available() > -0.01,
            "a refusal reserves nothing: {}",
            budget.available()
        );
    }

    #[test]
    fn tokens_refill_over_time_up_to_the_capacity() {
        let budget = budget(2.0, 50.0);
        let far = Instant::now() + Duration::from_secs(60);
        budget.reserve(far);
        budget.reserve(far);
        std::thread::sleep(Duration::from_millis(100));
        assert!((budget.available() - 2.0).abs() < 1e-9, "capped at the capacity");
    }
}
