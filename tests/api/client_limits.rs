//! Where `oncepay_client` stops retrying: the attempt count, the deadline, the retry
//! budget, and no server at all. Each stop says whether the outcome is unknown.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oncepay_client::{BudgetConfig, Client, ClientConfig, ClientError, IdempotencyKey};

use crate::client::{client_for, fast_config};
use crate::support::fault_proxy::{Action, FaultProxy};
use crate::support::helpers::spawn_app;

fn unavailable(retry_after_secs: Option<u64>) -> Action {
    Action::Problem {
        status: 503,
        code: "temporarily_unavailable",
        retry_after_secs,
    }
}

#[tokio::test]
async fn retryable_answers_stop_after_max_attempts_with_the_last_problem() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |_| unavailable(Some(0))).await;
    let client = client_for(
        &proxy.url,
        &app,
        ClientConfig {
            max_attempts: 3,
            ..fast_config()
        },
    );

    let err = client.pay(100, None, &IdempotencyKey::generate()).await.unwrap_err();

    assert_eq!((err.status(), err.code()), (Some(503), "temporarily_unavailable"));
    assert!(
        err.outcome_unknown(),
        "a 503 leaves the operation to be resumed with its key"
    );
    assert_eq!(proxy.seen().len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_stops_retries_and_the_same_key_later_resumes_the_operation_once() {
    let app = spawn_app().await;
    // Every answer is held past the client's timeout, after the server processed the request.
    let proxy = FaultProxy::start(&app.address, |_| Action::DelayAnswer(Duration::from_secs(2))).await;
    let client = client_for(
        &proxy.url,
        &app,
        ClientConfig {
            attempt_timeout: Duration::from_millis(300),
            deadline: Duration::from_secs(1),
            max_attempts: 100,
            ..fast_config()
        },
    );
    let key = IdempotencyKey::generate();

    let started = Instant::now();
    let err = client.pay(100, None, &key).await.unwrap_err();

    assert!(
        started.elapsed() < Duration::from_millis(1_500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(err.code(), "deadline_exceeded", "{err}");
    assert!(err.outcome_unknown());
    let seen = proxy.seen();
    assert!(seen.len() >= 2, "it retried before the deadline: {}", seen.len());
    assert!(seen.iter().all(|s| s.key.as_deref() == Some(key.as_str())));
    assert_eq!(app.payment_count().await, 1, "several attempts, one payment");

    let resumed = client_for(&app.address, &app, fast_config())
        .pay(100, None, &key)
        .await
        .unwrap();
    assert!(resumed.replayed, "resuming with the key returns the stored answer");
    assert_eq!(app.payment_count().await, 1);
}

#[tokio::test]
async fn an_empty_retry_budget_stops_retries_instead_of_adding_load() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |_| unavailable(None)).await;
    let client = client_for(
        &proxy.url,
        &app,
        ClientConfig {
            deadline: Duration::from_secs(5),
            // One token, the next one 100 s away: past the deadline.
            budget: BudgetConfig {
                capacity: 1.0,
                refill_per_sec: 0.01,
            },
            ..fast_config()
        },
    );

    let started = Instant::now();
    let err = client.pay(100, None, &IdempotencyKey::generate()).await.unwrap_err();

    assert!(
        started.elapsed() < Duration::from_secs(2),
        "it does not wait for a token it cannot get"
    );
    assert_eq!(err.code(), "retry_budget_exhausted", "{err}");
    assert!(matches!(&err, ClientError::BudgetExhausted { last, .. } if last.status() == Some(503)));
    assert_eq!(proxy.seen().len(), 2, "the first attempt and the one budgeted retry");
}

#[tokio::test]
async fn no_server_is_a_transport_error_retried_then_returned_as_unknown_outcome() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let retries = Arc::new(AtomicU32::new(0));
    let counter = retries.clone();
    let client = Client::builder(&url, "any")
        .config(ClientConfig {
            max_attempts: 3,
            ..fast_config()
        })
        .on_retry(move |note| {
            assert_eq!(note.error.code(), "transport_error");
            counter.fetch_add(1, Ordering::SeqCst);
        })
        .build()
        .unwrap();

    let err = client.account("main").await.unwrap_err();

    assert_eq!(err.code(), "transport_error", "{err}");
    assert!(
        err.outcome_unknown(),
        "a later retry may reach it: the same key stays safe"
    );
    assert!(err.nothing_sent(), "no attempt could connect: {err}");
    assert_eq!(retries.load(Ordering::SeqCst), 2, "three attempts, two retries");
}

#[test]
fn a_client_refuses_bad_settings_before_sending_anything() {
    for (url, api_key) in [
        ("not a url", "k"),
        ("ftp://127.0.0.1:1", "k"),
        ("http://127.0.0.1:1", "bad\nkey"),
    ] {
        let err = Client::builder(url, api_key).build().err().expect("refused");
        assert_eq!(err.code(), "invalid_argument", "{url} {api_key:?}: {err}");
    }
    let zero = ClientConfig {
        max_attempts: 0,
        ..ClientConfig::default()
    };
    let err = Client::builder("http://127.0.0.1:1", "k")
        .config(zero)
        .build()
        .err()
        .expect("refused");
    assert_eq!(err.code(), "invalid_argument");
}
