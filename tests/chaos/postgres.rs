//! PostgreSQL stopped and restarted under load, and backends terminated at random.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rand::Rng;

use crate::harness::{self, Server};
use crate::ledger::{self, Ledger, Outcome};

/// The longest any request may take while the database is down: the pool's acquire timeout
/// (1 s in these tests) plus a margin for a loaded two-core machine.
const ANSWER_BOUND: Duration = Duration::from_secs(3);

fn addresses(servers: &[Server]) -> Vec<String> {
    servers.iter().map(|s| s.address.clone()).collect()
}

#[tokio::test]
#[ignore = "stops PostgreSQL and kills processes: run with `make chaos`"]
async fn postgres_restarted_under_load_fails_fast_and_recovers_without_a_restart() {
    let pool = harness::pool().await;
    let tenant = harness::tenant(&pool).await;
    let mut servers = [Server::start(&[]).await, Server::start(&[]).await];
    let addresses = addresses(&servers);
    let client = ledger::client();
    let mut ledger = Ledger::new(3_000);
    let stop = AtomicBool::new(false);

    let fault = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        harness::stop_postgres().await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        for server in &servers {
            let asked = Instant::now();
            assert_eq!(server.readyz().await, 503, "/readyz while PostgreSQL is down");
            assert!(asked.elapsed() < ANSWER_BOUND, "/readyz took {:?}", asked.elapsed());
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        harness::start_postgres().await;
        let started = Instant::now();
        for server in &servers {
            while server.readyz().await != 200 {
                assert!(started.elapsed() < Duration::from_secs(15), "no recovery within 15 s");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        eprintln!(
            "postgres restart: both servers ready {:?} after PostgreSQL started",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.store(true, Ordering::Relaxed);
    };
    tokio::join!(ledger.load(&client, &addresses, &tenant, 8, &stop), fault);

    let slowest = ledger.all_attempts().iter().map(|a| a.elapsed).max().unwrap();
    let unavailable = ledger.count(|o| matches!(o, Outcome::Retry { status: 503, .. }));
    let no_answer = ledger.count(|o| matches!(o, Outcome::NoAnswer(_)));
    eprintln!(
        "postgres restart: {} requests, {unavailable} answered 503, {no_answer} unanswered, slowest {slowest:?}",
        ledger.all_attempts().len()
    );
    assert!(unavailable > 0, "no request saw the outage: the test proved nothing");
    assert_eq!(no_answer, 0, "every request gets an answer while PostgreSQL is down");
    assert!(slowest < ANSWER_BOUND, "a request took {slowest:?}");
    for server in &mut servers {
        server.assert_alive();
    }

    ledger.settle(&client, &[&addresses[0], &addresses[1]], &tenant).await;
    ledger.verify(&pool, &client, &addresses[0], &tenant).await;
}

#[tokio::test]
#[ignore = "stops PostgreSQL and kills processes: run with `make chaos`"]
async fn backends_terminated_at_random_under_load_lose_nothing() {
    let pool = harness::pool().await;
    let tenant = harness::tenant(&pool).await;
    let mut servers = [Server::start(&[]).await, Server::start(&[]).await];
    let addresses = addresses(&servers);
    let client = ledger::client();
    let mut ledger = Ledger::new(3_000);
    let stop = AtomicBool::new(false);

    let terminator = async {
        let mut terminated = 0i64;
        let deadline = Instant::now() + Duration::from_secs(4);
        while Instant::now() < deadline {
            let pause = rand::thread_rng().gen_range(10..60);
            tokio::time::sleep(Duration::from_millis(pause)).await;
            terminated += sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
                   FROM (SELECT pid FROM pg_stat_activity
                          WHERE application_name = 'oncepay' AND datname = current_database()
                          ORDER BY random() LIMIT 1) victim",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        terminated
    };
    let ((), terminated) = tokio::join!(ledger.load(&client, &addresses, &tenant, 8, &stop), terminator);

    let unavailable = ledger.count(|o| matches!(o, Outcome::Retry { status: 503, .. }));
    eprintln!(
        "terminate: {terminated} backends terminated, {} requests, {unavailable} answered 503",
        ledger.all_attempts().len()
    );
    assert!(
        terminated > 0 && unavailable > 0,
        "no fault reached a request: the test proved nothing"
    );
    assert_eq!(ledger.count(|o| matches!(o, Outcome::NoAnswer(_))), 0);
    for server in &mut servers {
        server.assert_alive();
    }

    ledger.settle(&client, &[&addresses[0], &addresses[1]], &tenant).await;
    ledger.verify(&pool, &client, &addresses[1], &tenant).await;
}
