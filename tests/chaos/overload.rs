//! More demand than the server can take: the pool exhausted for longer than its wait, and
//! slow clients holding connections open.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use sqlx::Connection;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::{self, Server};
use crate::ledger::{self, Ledger, Outcome};

#[tokio::test]
#[ignore = "stops PostgreSQL and kills processes: run with `make chaos`"]
async fn an_exhausted_pool_answers_429_at_once_instead_of_queueing() {
    let pool = harness::pool().await;
    let tenant = harness::tenant(&pool).await;
    // Each payment in a statement of its own, so that the two holders hold the pool's two
    // connections (batched, they could share one statement and one connection). The batch
    // queue's own bound is tests/api/batch.rs.
    let server = Server::start(&[
        ("ONCEPAY_DB_POOL_SIZE", "2"),
        ("ONCEPAY_DB_ACQUIRE_TIMEOUT_MS", "300"),
        ("ONCEPAY_DB_BATCH_MAX", "1"),
    ])
    .await;
    let client = ledger::client();
    let ledger = Ledger::new(42);

    // Our lock on the account row keeps two payments in their transactions, holding both
    // pooled connections, for longer than the acquire wait.
    let mut lock = sqlx::PgConnection::connect(&harness::database_url()).await.unwrap();
    sqlx::query("BEGIN").execute(&mut lock).await.unwrap();
    sqlx::query("SELECT 1 FROM accounts WHERE tenant_id = $1 AND account_id = 'main' FOR UPDATE")
        .bind(tenant.id)
        .execute(&mut lock)
        .await
        .unwrap();
    let holders = join_all((0..2).map(|i| ledger.send(&client, &server.address, &tenant, i)));
    let flood = async {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'oncepay' AND wait_event_type = 'Lock'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            if waiting == 2 {
                break;
            }
            assert!(Instant::now() < deadline, "the two holders never blocked");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let answers = join_all((2..42).map(|i| ledger.send(&client, &server.address, &tenant, i))).await;
        sqlx::query("ROLLBACK").execute(&mut lock).await.unwrap();
        answers
    };
    let (held, flooded) = tokio::join!(holders, flood);

    for attempt in &held {
        assert!(matches!(attempt.outcome, Outcome::Charged { .. }), "{attempt:?}");
    }
    let slowest = flooded.iter().map(|a| a.elapsed).max().unwrap();
    eprintln!("pool exhaustion: 40 requests over a full pool, slowest answered in {slowest:?}");
    for attempt in &flooded {
        // Retry means 429 overloaded or 503, with Retry-After (see ledger::classify).
        assert!(
            matches!(attempt.outcome, Outcome::Retry { status: 429 | 503, .. }),
            "{attempt:?}"
        );
    }
    assert!(slowest < Duration::from_secs(2), "a request queued for {slowest:?}");

    ledger.settle(&client, &[&server.address], &tenant).await;
    ledger.verify(&pool, &client, &server.address, &tenant).await;
}

/// Sends `head` then trickles `trickle` one byte every 200 ms; returns how long the
/// server kept the connection open (at most 20 s, then the test fails).
async fn slow_client(address: &str, head: String, trickle: &'static [u8]) -> Duration {
    let mut stream = TcpStream::connect(address.trim_start_matches("http://")).await.unwrap();
    let opened = Instant::now();
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut buf = [0u8; 1024];
    for byte in trickle.iter().cycle() {
        assert!(
            opened.elapsed() < Duration::from_secs(20),
            "a slow client was kept for 20 s"
        );
        tokio::select! {
            read = stream.read(&mut buf) => match read {
                Ok(0) | Err(_) => return opened.elapsed(),
                // An answer (408); the close follows.
                Ok(_) => continue,
            },
            () = tokio::time::sleep(Duration::from_millis(200)) => {
                if stream.write_all(&[*byte]).await.is_err() {
                    return opened.elapsed();
                }
            }
        }
    }
    unreachable!("the trickle cycles forever")
}

#[tokio::test]
#[ignore = "stops PostgreSQL and kills processes: run with `make chaos`"]
async fn slow_clients_are_dropped_while_others_are_served() {
    let pool = harness::pool().await;
    let tenant = harness::tenant(&pool).await;
    let server = Server::start(&[]).await;
    let client = ledger::client();
    let ledger = Ledger::new(40);

    let slow_headers = (0..30).map(|_| {
        slow_client(
            &server.address,
            "POST /payments HTTP/1.1\r\nHost: 127.0.0.1\r\n".to_owned(),
            b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n",
        )
    });
    let body_head = format!(
        "POST /payments HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {}\r\nIdempotency-Key: slow-{}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n",
        tenant.api_key,
        uuid::Uuid::new_v4()
    );
    let slow_bodies = (0..10).map(|_| slow_client(&server.address, body_head.clone(), b" "));
    let served = async {
        let mut slowest = Duration::ZERO;
        for i in 0..ledger.ops.len() {
            let attempt = ledger.send(&client, &server.address, &tenant, i).await;
            assert!(matches!(attempt.outcome, Outcome::Charged { .. }), "{attempt:?}");
            slowest = slowest.max(attempt.elapsed);
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        slowest
    };
    let (headers_kept, bodies_kept, slowest) = tokio::join!(join_all(slow_headers), join_all(slow_bodies), served);

    let longest = |kept: &[Duration]| kept.iter().max().copied().unwrap();
    eprintln!(
        "slow clients: header trickles dropped after at most {:?}, body trickles after at most {:?}; \
         others served in at most {slowest:?}",
        longest(&headers_kept),
        longest(&bodies_kept)
    );
    // Headers within 5 s (client_request_timeout), the body within its read timeout.
    assert!(longest(&headers_kept) < Duration::from_secs(8));
    assert!(longest(&bodies_kept) < Duration::from_secs(8));
    assert!(slowest < Duration::from_secs(1), "a normal request took {slowest:?}");
    ledger.verify(&pool, &client, &server.address, &tenant).await;
}
