//! How many batch statements a process keeps in flight, chosen from what it observes.
//!
//! A fixed number is the wrong interface: two statements in flight left a third of a fast
//! host idle while payments waited (each statement waits for its commit's WAL flush, and
//! only two overlap), eight filled it but shrank the batches, so every payment cost
//! PostgreSQL a quarter more, and the best number moves with the host (docs/bench/README.md).
//! So the limit follows the statements' latency, as TCP Vegas and Netflix's concurrency
//! limits do with round-trip times:
//!
//! - **The baseline.** A statement's latency grows with its batch (each payment is work), so
//!   it is compared with the least latency seen for batches of its size class (1, 2-3, 4-7,
//!   ...): the time the database takes when nothing queues in front of it. The least is
//!   forgotten only window by window of *calm* samples (statements that came back with at
//!   most half the limit out, so little queued beside them): a lasting change of the host (a
//!   failover to a slower node) is learned within two windows of [`WINDOW`] calm samples once
//!   the limit has come down to it, and a busy host never mistakes its own queueing for the
//!   baseline (which would raise the limit on and on: a minimum taken over busy samples
//!   alone grows with the limit).
//! - **What queues.** As TCP Vegas does, the statements queued in the database are estimated
//!   from a statement's latency and its baseline: `in flight x (1 - baseline / latency)`, the
//!   statements that would still be out had each taken only its baseline. Judging the queue
//!   rather than the ratio lets a small limit grow through the jitter of a shared host (one
//!   statement at 1.5x its baseline is half a statement queued: room) and holds a large one
//!   as soon as a few statements wait.
//! - **Raised** by `1 / limit` (one a round of statements, additively) when fewer than
//!   [`ALPHA`] statements queue while payments waited and the limit was what held them: the
//!   database has room, and more statements in flight use it.
//! - **Lowered** to [`BACKOFF`] of itself, and by one whole statement at least, when more
//!   than [`BETA`] queue, or a statement took [`STEP`] its baseline (a stall, whatever the
//!   limit): the database is the bound (its CPU, its locks, its disk), and more statements only
//!   queue there, each with a smaller batch, at a higher cost per payment. At most once a round
//!   (as many samples as the limit), so one slow moment is one step down.
//! - Between the two it holds. It never goes below [`FLOOR`] (two: one statement stuck on a
//!   row lock leaves a slot to everyone else) nor above the ceiling (the pool).
//!
//! A fixed limit (`ONCEPAY_DB_BATCHES_IN_FLIGHT`) is the same type, which never moves.

use std::time::Duration;

/// Fewer statements queued than this, while payments waited on the limit, raise the limit.
pub const ALPHA: f64 = 2.0;
/// More statements queued than this lower the limit.
pub const BETA: f64 = 4.0;
/// A statement at this multiple of its baseline or more lowers the limit, however small.
pub const STEP: f64 = 4.0;
/// What a lowering multiplies the limit by.
pub const BACKOFF: f64 = 0.9;
/// The least the adaptive limit goes down to: two statements, so that one stuck on a row lock
/// (a hot account, a duplicate of a key another replica runs, a row an operator's session
/// holds) never takes every slot. At one, a statement waiting seconds on a lock held every
/// other tenant's payments until they were refused (429), the pool idle: the rule lowers the
/// limit on a stall, and a statement that does not come back gives it nothing to raise it by.
pub const FLOOR: usize = 2;
/// Samples of one size class after which its older window of minimums is forgotten.
pub const WINDOW: u32 = 500;
/// Size classes: batches of 1, 2-3, 4-7, ..., 512 and more.
const CLASSES: usize = 10;

/// One statement that came back.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// From sending the statement to reading its answer.
    pub latency: Duration,
    /// Payments it carried.
    pub items: usize,
    /// Statements out when it came back, itself included.
    pub in_flight: usize,
    /// Whether payments were waiting for a slot when it came back.
    pub waiting: bool,
}

/// What a sample did to the limit (its whole part, which is what the dispatcher uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    Raised,
    Lowered,
    Held,
}

/// The least latency of one size class, over its current and its previous window; a window
/// ends after [`WINDOW`] calm samples (any sample lowers its least).
#[derive(Clone, Copy, Debug, Default)]
struct Baseline {
    current: Option<Duration>,
    previous: Option<Duration>,
    calm_samples: u32,
}

impl Baseline {
    fn observe(&mut self, latency: Duration, calm: bool) -> Duration {
        if calm {
            if self.calm_samples >= WINDOW {
                self.previous = self.current;
                self.current = None;
                self.calm_samples = 0;
            }
            self.calm_samples += 1;
        }
        self.current = Some(self.current.map_or(latency, |least| least.min(latency)));
        self.least().unwrap_or(latency)
    }

    fn least(&self) -> Option<Duration> {
        match (self.current, self.previous) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// The limit on statements in flight.
#[derive(Clone, Debug)]
pub struct Limit {
    value: f64,
    floor: f64,
    ceiling: f64,
    adaptive: bool,
    baselines: [Baseline; CLASSES],
    /// Samples to go before the limit may be lowered again.
    calm: usize,
}

impl Limit {
    /// A limit that starts at `initial` and moves between [`FLOOR`] (or `ceiling`, if lower)
    /// and `ceiling`.
    pub fn adaptive(initial: usize, ceiling: usize) -> Self {
        let ceiling = ceiling.max(1) as f64;
        Self {
            value: (initial.max(FLOOR) as f64).min(ceiling),
            floor: (FLOOR as f64).min(ceiling),
            ceiling,
            adaptive: true,
            baselines: [Baseline::default(); CLASSES],
            calm: 0,
        }
    }

    /// A limit that stays at `n`.
    pub fn fixed(n: usize) -> Self {
        let n = n.max(1) as f64;
        Self {
            value: n,
            floor: n,
            ceiling: n,
            adaptive: false,
            baselines: [Baseline::default(); CLASSES],
            calm: 0,
        }
    }

    /// Statements that may be in flight now.
    pub fn current(&self) -> usize {
        self.value as usize
    }

    pub fn is_adaptive(&self) -> bool {
        self.adaptive
    }

    /// The least latency seen for a statement of one payment (the size class the others are
    /// scaled from), if any came back yet.
    pub fn least_latency(&self) -> Option<Duration> {
        self.baselines.iter().find_map(Baseline::least)
    }

    /// Takes a statement's latency into account.
    pub fn observe(&mut self, sample: Sample) -> Change {
        let calm = sample.in_flight <= (self.current() / 2).max(1);
        let baseline = self.baselines[class_of(sample.items)].observe(sample.latency, calm);
        if !self.adaptive {
            return Change::Held;
        }
        self.calm = self.calm.saturating_sub(1);
        let before = self.current();
        let ratio = sample.latency.as_secs_f64() / baseline.as_secs_f64().max(1e-9);
        let queued = sample.in_flight as f64 * (1.0 - 1.0 / ratio.max(1.0));
        if queued > BETA || ratio >= STEP {
            if self.calm == 0 {
                // By one whole statement at least: the dispatcher counts whole statements, so
                // a step within one (2.3 to 2.1) would change nothing it does.
                self.value = (self.value * BACKOFF).min(self.value.floor() - 1.0).max(self.floor);
                self.calm = self.current();
            }
        } else if queued < ALPHA && sample.waiting && sample.in_flight >= before {
            self.value = (self.value + 1.0 / self.value).min(self.ceiling);
        }
        match self.current().cmp(&before) {
            std::cmp::Ordering::Greater => Change::Raised,
            std::cmp::Ordering::Less => Change::Lowered,
            std::cmp::Ordering::Equal => Change::Held,
        }
    }
}

/// The size class of a batch of `items`: the binary logarithm, capped.
fn class_of(items: usize) -> usize {
    (usize::BITS - 1 - items.max(1).leading_zeros()).min(CLASSES as u32 - 1) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: f64) -> Duration {
        Duration::from_secs_f64(ms / 1e3)
    }

    /// A database that runs `capacity` statements at once without queueing and shares itself
    /// among more (processor sharing): a statement's latency is its work times the
    /// oversubscription.
    fn latency(work: Duration, in_flight: usize, capacity: usize) -> Duration {
        work.mul_f64((in_flight as f64 / capacity as f64).max(1.0))
    }

    /// Feeds `rounds` rounds of samples with `limit` statements in flight and work waiting.
    fn run(limit: &mut Limit, rounds: usize, capacity: usize, work: Duration) -> Vec<usize> {
        let mut seen = Vec::new();
        for _ in 0..rounds {
            let in_flight = limit.current();
            for _ in 0..in_flight {
                limit.observe(Sample {
                    latency: latency(work, in_flight, capacity),
                    items: 8,
                    in_flight,
                    waiting: true,
                });
            }
            seen.push(limit.current());
        }
        seen
    }

    #[test]
    fn size_classes_double() {
        let classes: Vec<usize> = [0, 1, 2, 3, 4, 7, 8, 31, 32, 1000, 100_000].map(class_of).to_vec();
        assert_eq!(classes, [0, 0, 1, 1, 2, 2, 3, 4, 5, 9, 9]);
    }

    #[test]
    fn it_rises_while_the_database_has_room_and_payments_wait() {
        let mut limit = Limit::adaptive(2, 32);
        let seen = run(&mut limit, 200, 16, ms(2.0));
        assert!(limit.current() >= 16, "stopped at {} ({seen:?})", limit.current());
        // No higher than the database's room allows with work queued in it.
        assert!(limit.current() <= 32);
        // Payments not waiting: nothing to gain, it stays.
        let mut idle = Limit::adaptive(2, 32);
        for _ in 0..1000 {
            idle.observe(Sample {
                latency: ms(2.0),
                items: 1,
                in_flight: 2,
                waiting: false,
            });
        }
        assert_eq!(idle.current(), 2);
        // Nor while fewer statements are out than it allows (the limit is not what holds).
        for _ in 0..1000 {
            idle.observe(Sample {
                latency: ms(2.0),
                items: 1,
                in_flight: 1,
                waiting: true,
            });
        }
        assert_eq!(idle.current(), 2);
    }

    #[test]
    fn a_stall_takes_one_whole_statement_away_even_from_a_small_limit() {
        let mut limit = Limit::adaptive(3, 32);
        let calm = Sample {
            latency: ms(2.0),
            items: 1,
            in_flight: 3,
            waiting: true,
        };
        // Room and payments waiting: 3 becomes 3.33, still three statements.
        assert_eq!(limit.observe(calm), Change::Held);
        assert_eq!(limit.current(), 3);
        // A stall: 3.33 x BACKOFF would still be three statements, which would change nothing.
        let stall = Sample {
            latency: ms(300.0),
            ..calm
        };
        assert_eq!(limit.observe(stall), Change::Lowered);
        assert_eq!(limit.current(), 2);
        // Not below the floor: one statement stuck on a lock leaves one slot.
        for _ in 0..4 {
            limit.observe(Sample { in_flight: 2, ..stall });
        }
        assert_eq!(limit.current(), FLOOR);
    }

    #[test]
    fn it_falls_on_a_latency_step_and_rises_again_once_it_is_learned() {
        let mut limit = Limit::adaptive(2, 64);
        run(&mut limit, 300, 16, ms(2.0));
        let before = limit.current();
        assert!(before >= 16, "{before}");
        // The database slows down threefold (another workload takes its CPU): one statement's
        // room in place of sixteen.
        let seen = run(&mut limit, 30, 4, ms(6.0));
        assert!(
            *seen.iter().min().unwrap() <= before / 2,
            "it did not fall: {before} then {seen:?}"
        );
        assert!(limit.current() >= 1);
        // Then it settles near that database's room, no further, its baseline the old one
        // while it stays busy (relearned from calm samples only).
        run(&mut limit, 2_000, 4, ms(6.0));
        assert!((2..=8).contains(&limit.current()), "{}", limit.current());
        // Stalls bring it down to the floor, and never below (within a window: longer, and the
        // slow database is the baseline, as above).
        let mut floor = Limit::adaptive(4, 8);
        floor.observe(Sample {
            latency: ms(1.0),
            items: 1,
            in_flight: 1,
            waiting: false,
        });
        for _ in 0..400 {
            let in_flight = floor.current();
            floor.observe(Sample {
                latency: ms(50.0),
                items: 1,
                in_flight,
                waiting: true,
            });
        }
        assert_eq!(floor.current(), FLOOR);
        // A pool smaller than the floor is the ceiling.
        assert_eq!(Limit::adaptive(4, 1).current(), 1);
    }

    #[test]
    fn under_a_steady_load_it_stays_within_a_band() {
        // Capacity 8: latency is at its baseline up to 8 in flight and grows beyond.
        let mut limit = Limit::adaptive(2, 64);
        let seen = run(&mut limit, 2_000, 8, ms(2.0));
        let settled = &seen[500..];
        let (low, high) = (*settled.iter().min().unwrap(), *settled.iter().max().unwrap());
        // Never below the room (where it would leave the database idle), never past twice it
        // (where statements queue at twice their baseline and it steps down).
        assert!(low >= 8 && high <= 16, "band {low}..={high}: {:?}", &settled[..50]);
        // And it does not swing across that band: steps of one.
        let widest_step = settled.windows(2).map(|w| w[0].abs_diff(w[1])).max().unwrap();
        assert!(widest_step <= 2, "a step of {widest_step}");
    }

    #[test]
    fn through_a_shared_hosts_jitter_a_small_limit_still_grows() {
        // Every statement at 1.5x to 2x its baseline (another process's CPU, a slower commit):
        // as a ratio, "latency grew"; as a queue, at two in flight one statement at most.
        let mut limit = Limit::adaptive(1, 32);
        limit.observe(Sample {
            latency: ms(2.0),
            items: 4,
            in_flight: 1,
            waiting: false,
        });
        for i in 0..2_000 {
            let in_flight = limit.current();
            let jitter = if i % 2 == 0 { 1.5 } else { 2.0 };
            limit.observe(Sample {
                latency: ms(2.0 * jitter),
                items: 4,
                in_flight,
                waiting: true,
            });
        }
        assert!((3..=8).contains(&limit.current()), "{}", limit.current());
    }

    #[test]
    fn a_fixed_limit_never_moves() {
        let mut limit = Limit::fixed(3);
        for latency in [1.0, 100.0, 1.0] {
            for _ in 0..100 {
                assert_eq!(
                    limit.observe(Sample {
                        latency: ms(latency),
                        items: 4,
                        in_flight: 3,
                        waiting: true
                    }),
                    Change::Held
                );
            }
        }
        assert_eq!(limit.current(), 3);
        assert_eq!(limit.least_latency(), Some(ms(1.0)));
    }
}
