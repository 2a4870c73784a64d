//! A brownout: every request fails for 5 seconds. The retry budget, shared by the 20
//! concurrent callers of one client, keeps their retries under its rate and spread over
//! time, and every operation completes once the endpoint recovers.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use oncepay_client::{Backoff, BudgetConfig, ClientConfig, IdempotencyKey};

use crate::client::client_for;
use crate::support::fault_proxy::{Action, FaultProxy};
use crate::support::helpers::{spawn_app, MAIN_BALANCE};

const CALLERS: usize = 20;
const BROWNOUT: Duration = Duration::from_secs(5);
const CAPACITY: f64 = 5.0;
const REFILL_PER_SEC: f64 = 8.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_a_brownout_retries_stay_under_the_budget_and_every_operation_completes() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |incoming| {
        if incoming.elapsed < BROWNOUT {
            Action::PlainError { status: 503 }
        } else {
            Action::Forward
        }
    })
    .await;
    let client = client_for(
        &proxy.url,
        &app,
        ClientConfig {
            attempt_timeout: Duration::from_secs(5),
            max_attempts: 1_000,
            deadline: Duration::from_secs(30),
            // Without a budget, 20 callers backing off at most 500 ms would send ~40+ retries a second.
            backoff: Backoff {
                base: Duration::from_millis(50),
                cap: Duration::from_millis(500),
            },
            budget: BudgetConfig {
                capacity: CAPACITY,
                refill_per_sec: REFILL_PER_SEC,
            },
            ..ClientConfig::default()
        },
    );

    let started = Instant::now();
    let replies = join_all((0..CALLERS).map(|_| {
        let client = client.clone();
        async move { client.pay(10, None, &IdempotencyKey::generate()).await }
    }))
    .await;
    let took = started.elapsed();

    for reply in &replies {
        let reply = reply.as_ref().expect("every operation completes after the brownout");
        assert!(
            !reply.replayed,
            "no answer was lost: the server saw each operation once"
        );
    }
    assert_eq!(app.payment_count().await, CALLERS as i64);
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 10 * CALLERS as i64);

    let seen = proxy.seen();
    let failed: Vec<Duration> = seen.iter().filter(|s| s.at < BROWNOUT).map(|s| s.at).collect();
    let mut per_second = [0usize; 5];
    for at in &failed {
        per_second[at.as_secs() as usize] += 1;
    }
    let rate = failed.len() as f64 / BROWNOUT.as_secs_f64();
    eprintln!(
        "brownout: {} attempts in {BROWNOUT:?} ({rate:.1}/s), per second {per_second:?}; {} attempts in all; done in {took:?}",
        failed.len(),
        seen.len()
    );
    // First attempts are free; retries take a token: at most capacity + refill * t of them.
    let bound = CALLERS as f64 + CAPACITY + REFILL_PER_SEC * BROWNOUT.as_secs_f64();
    assert!(
        (failed.len() as f64) <= bound + 1.0,
        "{} attempts > bound {bound}",
        failed.len()
    );
    // After the first second, each second holds at most what the bucket can give in one
    // second (a leftover of the burst, then the refill), and at least half the refill: the
    // retries are spread over the whole brownout, not bunched at its start or end.
    for (second, count) in per_second.iter().enumerate().skip(1) {
        let most = CAPACITY + REFILL_PER_SEC + 1.0;
        assert!((*count as f64) <= most, "second {second}: {count} attempts > {most}");
        assert!(
            *count as f64 >= REFILL_PER_SEC / 2.0,
            "second {second}: only {count} attempts"
        );
    }
    assert!(
        took < Duration::from_secs(15),
        "recovered operations finish promptly: {took:?}"
    );
}
