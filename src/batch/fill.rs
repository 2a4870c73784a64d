//! How long a free slot waits for its batch to fill.
//!
//! Sent the moment a slot frees, a batch holds whatever waits then. In a closed loop that is
//! often one payment: the clients of the statement that just came back are still reading
//! their answers, and their next payments arrive a moment later, behind a slot now taken by a
//! statement of one. A third to a half of all statements carried a single payment (c=8 and
//! c=32, `make bench`'s "alone" column), and a payment alone costs PostgreSQL about twice
//! what it costs in a batch of eight (its statement's start, its commit and its WAL flush are
//! all its own).
//!
//! So a free slot waits for more payments while all of these hold:
//!
//! - **the statements out carry at least the batch it waits for** (see below): their
//!   answers bring their clients back with their next payments, and the database is not idle
//!   meanwhile. With fewer out, what comes back cannot make the batch: at two clients, one
//!   payment out and one waiting, the wait ran the two in turn while the machine idled (c=2
//!   did what c=1 did, 1,518 against 1,479 payments/s). `make bench-ab` of 2026-12-06, three
//!   rounds, against waiting whenever another statement was out: c=2 1.13x (1,855 / 1,642;
//!   p99 0.90x), c=8 0.99x, c=32 1.04x;
//! - **fewer payments wait than half the recent batch** (the mean over about [`SPAN`]
//!   statements), and at least two: a batch as large as the recent ones goes at once;
//! - **for less than one statement's least latency** (a statement of one payment, nothing
//!   queued beside it: the baseline of [`super::limit`]): the longest a payment waits here is
//!   what sending it alone would have taken in any case. Before any statement has come back
//!   there is no baseline, and nothing waits. And never longer than [`MAX_WAIT`]: a baseline
//!   learned while every statement waited on a lock or a stalled database is long, and what
//!   a free slot waits for is clients coming back from their answers (a few hundred µs), not
//!   the database.
//!
//! Measured on the lab database (3.8 M payments, `/work/lab/run.sh`, 8 s a run, two pairs of
//! runs alternated): c=8 3,418 / 3,491 -> 3,632 / 3,531 payments/s, PostgreSQL CPU per
//! payment 289 / 281 -> 264 / 262 µs, statements of one payment 54 % -> 23 %; c=32 6,329 /
//! 6,360 -> 6,628 / 6,646, 36 % -> 12 %; c=128 (batches of 24) unchanged, 10,418 / 10,111 ->
//! 10,179 / 10,380 (docs/bench/README.md).

use std::time::Duration;

use tokio::time::Instant;

/// Statements the mean batch size is taken over (the weight of a new one is `1 / SPAN`).
pub const SPAN: f64 = 16.0;

/// The longest a free slot waits, whatever the baseline (a lone statement took 0.53 ms on the
/// lab's host): past it a wait no longer pays for itself, and a payment must never near its
/// queue wait (`ONCEPAY_DB_ACQUIRE_TIMEOUT_MS`, then 429) by waiting here.
pub const MAX_WAIT: Duration = Duration::from_millis(1);

/// The recent batch size, and the rule it sets.
#[derive(Clone, Copy, Debug)]
pub struct Fill {
    /// Payments per statement, a moving mean.
    mean: f64,
}

impl Default for Fill {
    fn default() -> Self {
        Self { mean: 1.0 }
    }
}

impl Fill {
    /// A statement of `items` payments was sent.
    pub fn launched(&mut self, items: usize) {
        self.mean += (items as f64 - self.mean) / SPAN;
    }

    /// Payments that make a batch worth sending at once while another statement is out.
    pub fn target(&self) -> usize {
        ((self.mean / 2.0).round() as usize).max(2)
    }

    /// Until when a slot free since `free_since` waits for more payments, with `out`
    /// payments in the statements out and `waiting` payments waiting, at `now`; `None`: it
    /// sends now (or, with nothing waiting, waits for the first arrival as always). `least`: a
    /// statement's least latency, if one came back yet.
    pub fn wait_until(
        &self,
        out: usize,
        waiting: usize,
        free_since: Instant,
        least: Option<Duration>,
        now: Instant,
    ) -> Option<Instant> {
        let target = self.target();
        if out < target || waiting == 0 || waiting >= target {
            return None;
        }
        let until = free_since + least?.min(MAX_WAIT);
        (now < until).then_some(until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEAST: Option<Duration> = Some(Duration::from_micros(500));

    fn after(sizes: &[usize]) -> Fill {
        let mut fill = Fill::default();
        for &n in sizes {
            fill.launched(n);
        }
        fill
    }

    #[test]
    fn the_target_is_half_the_recent_batch_and_at_least_two() {
        assert_eq!(Fill::default().target(), 2);
        assert_eq!(after(&[16; 200]).target(), 8);
        assert_eq!(after(&[3; 200]).target(), 2);
        assert_eq!(after(&[10; 200]).target(), 5);
        // It follows a change of load within a few spans.
        assert_eq!(after(&[[16; 200].as_slice(), &[4; 100]].concat()).target(), 2);
    }

    #[test]
    fn a_free_slot_waits_only_while_those_out_can_fill_it_few_wait_and_for_at_most_the_least_latency() {
        let fill = after(&[16; 200]);
        let now = Instant::now();
        let until = now + LEAST.unwrap();
        assert_eq!(fill.wait_until(16, 3, now, LEAST, now), Some(until));
        assert_eq!(
            fill.wait_until(0, 3, now, LEAST, now),
            None,
            "nothing out: nothing is coming back"
        );
        assert_eq!(
            fill.wait_until(7, 3, now, LEAST, now),
            None,
            "fewer out than the batch it would wait for: what comes back cannot make it"
        );
        assert_eq!(fill.wait_until(8, 3, now, LEAST, now), Some(until));
        assert_eq!(
            fill.wait_until(16, 8, now, LEAST, now),
            None,
            "as many as half a recent batch: go"
        );
        assert_eq!(
            fill.wait_until(16, 0, now, LEAST, now),
            None,
            "nothing waits: nothing to hold"
        );
        assert_eq!(
            fill.wait_until(16, 3, now, None, now),
            None,
            "no baseline yet: no waiting"
        );
        let lone = Fill::default();
        assert_eq!(
            lone.wait_until(1, 1, now, LEAST, now),
            None,
            "two clients, one out and one waiting: waiting would run them in turn"
        );
        assert_eq!(lone.wait_until(2, 1, now, LEAST, now), Some(until));
        let long_ago = now - Duration::from_micros(501);
        assert_eq!(
            fill.wait_until(16, 3, long_ago, LEAST, now),
            None,
            "the least latency waited: go"
        );
    }
}
