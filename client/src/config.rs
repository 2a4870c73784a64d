//! How hard the client tries: per-attempt timeout, attempt count, overall deadline, backoff
//! and the retry budget. Every knob has a default a payments service can start with.

use std::time::Duration;

use rand::Rng;

/// The client's retry settings; [`ClientConfig::default`] documents the defaults.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Upper bound of one attempt, from sending the request to the end of the answer.
    pub attempt_timeout: Duration,
    /// Upper bound of establishing one TCP connection.
    pub connect_timeout: Duration,
    /// Attempts per operation, the first included (1 = never retry).
    pub max_attempts: u32,
    /// Upper bound of a whole operation, all attempts and waits included.
    pub deadline: Duration,
    pub backoff: Backoff,
    pub budget: BudgetConfig,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            attempt_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(2),
            max_attempts: 6,
            deadline: Duration::from_secs(30),
            backoff: Backoff::default(),
            budget: BudgetConfig::default(),
        }
    }
}

/// Exponential backoff with full jitter: before retry `n` (1-based) the client waits a
/// uniformly random time in `[0, min(cap, base * 2^(n-1))]`, so that clients failed by the
/// same incident do not come back in lockstep.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(5),
        }
    }
}

impl Backoff {
    /// The ceiling of the wait before retry `retry` (1-based): `min(cap, base * 2^(retry-1))`.
    pub fn ceiling(&self, retry: u32) -> Duration {
        let doublings = retry.saturating_sub(1).min(31);
        self.base.saturating_mul(1 << doublings).min(self.cap)
    }

    /// A random wait before retry `retry`, full jitter under [`Backoff::ceiling`].
    pub fn delay(&self, retry: u32) -> Duration {
        let ceiling = self.ceiling(retry);
        rand::thread_rng().gen_range(Duration::ZERO..=ceiling)
    }
}

/// The retry budget: a token bucket shared by every operation of one client (and its clones).
/// A retry takes one token; first attempts take none. Tokens come back at `refill_per_sec`,
/// up to `capacity`. So whatever the number of failing operations, a client sends at most
/// `capacity + refill_per_sec * t` retries in any `t` seconds: a brownout of the server
/// cannot turn into a retry storm.
#[derive(Clone, Copy, Debug)]
pub struct BudgetConfig {
    pub capacity: f64,
    pub refill_per_sec: f64,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        Self {
            capacity: 50.0,
            refill_per_sec: 10.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_ceiling_doubles_up_to_the_cap() {
        let backoff = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_millis(1_000),
        };
        let ceilings: Vec<u128> = (1..=6).map(|n| backoff.ceiling(n).as_millis()).collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1_000, 1_000]);
        assert_eq!(
            backoff.ceiling(u32::MAX),
            backoff.cap,
            "no overflow on huge retry counts"
        );
    }

    #[test]
    fn jittered_delays_stay_under_the_ceiling_and_vary() {
        let backoff = Backoff::default();
        let delays: Vec<Duration> = (0..200).map(|_| backoff.delay(3)).collect();
        assert!(delays.iter().all(|d| *d <= backoff.ceiling(3)));
        let distinct: std::collections::HashSet<_> = delays.iter().collect();
        assert!(
            distinct.len() > 100,
            "full jitter spreads the waits: {} distinct",
            distinct.len()
        );
    }
}
