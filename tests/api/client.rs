//! `oncepay_client` against a real server, through the fault-injecting proxy: answers
//! lost after processing, `Retry-After` windows, refusals and requests in flight.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use futures_util::stream::{self, StreamExt};
use futures_util::TryStreamExt as _;
use oncepay_client::{
    AttemptListParams, Backoff, BudgetConfig, Client, ClientConfig, ClientError, EventListParams, IdempotencyKey,
    ListParams, PaymentListParams, TopUpListParams, TransferListParams,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use uuid::Uuid;

use crate::concurrency::{blocked_payment_backend, lock_main_account};
use crate::support::fault_proxy::{Action, FaultProxy};
use crate::support::helpers::{spawn_app, spawn_app_with, tenant_endpoints, TestApp, MAIN_BALANCE};

/// Short waits so that the tests stay fast; the budget large enough not to bind here.
pub fn fast_config() -> ClientConfig {
    ClientConfig {
        attempt_timeout: Duration::from_secs(5),
        max_attempts: 10,
        deadline: Duration::from_secs(30),
        backoff: Backoff {
            base: Duration::from_millis(10),
            cap: Duration::from_millis(200),
        },
        budget: BudgetConfig {
            capacity: 1_000.0,
            refill_per_sec: 1_000.0,
        },
        ..ClientConfig::default()
    }
}

pub fn client_for(url: &str, app: &TestApp, config: ClientConfig) -> Client {
    Client::builder(url, &app.api_key)
        .config(config)
        .build()
        .expect("client builds")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_payments_through_a_proxy_losing_30_percent_of_answers_debit_exactly_200_times() {
    let app = spawn_app().await;
    let rng = Mutex::new(StdRng::seed_from_u64(4));
    // 20% of answers dropped after processing, 10% held past the client's 1 s timeout.
    let proxy = FaultProxy::start(&app.address, move |_| match rng.lock().unwrap().gen_range(0..10) {
        0 | 1 => Action::DropAnswer,
        2 => Action::DelayAnswer(Duration::from_millis(1_500)),
        _ => Action::Forward,
    })
    .await;
    let client = client_for(
        &proxy.url,
        &app,
        ClientConfig {
            attempt_timeout: Duration::from_secs(1),
            max_attempts: 20,
            ..fast_config()
        },
    );
    let keys: Vec<IdempotencyKey> = (0..200).map(|_| IdempotencyKey::generate()).collect();

    let replies: Vec<_> = stream::iter(&keys)
        .map(|key| {
            let client = client.clone();
            async move { (key.as_str().to_owned(), client.pay(10, None, key).await) }
        })
        .buffer_unordered(20)
        .collect()
        .await;

    let replies: HashMap<String, _> = replies
        .into_iter()
        .map(|(key, reply)| (key, reply.expect("every operation is answered")))
        .collect();
    assert_eq!(replies.len(), 200, "one answer per operation");
    assert_eq!(app.payment_count().await, 200, "exactly 200 debits");
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 2_000);
    let answered: HashMap<String, Uuid> = replies.iter().map(|(k, r)| (k.clone(), r.value.id)).collect();
    let stored: Vec<(String, Uuid)> =
        sqlx::query_as("SELECT idempotency_key, payment_id FROM payments WHERE tenant_id = $1")
            .bind(app.tenant_id)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        answered,
        stored.into_iter().collect(),
        "each operation's answer names the one payment stored under its key"
    );

    // An attempt the client gave up on (timed out) may still be on its way through the
    // proxy, which logs a request once the server has answered it: wait for the stragglers.
    let sent: usize = replies.values().map(|r| r.attempts as usize).sum();
    for _ in 0..100 {
        if proxy.seen().len() >= sent {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seen = proxy.seen();
    let mut per_key: HashMap<String, Vec<&[u8]>> = HashMap::new();
    for request in &seen {
        assert_eq!(request.path, "/payments", "every attempt goes to the same path");
        let key = request.key.clone().expect("every attempt carries the key");
        per_key.entry(key).or_default().push(&request.body);
    }
    let lost: HashSet<&str> = seen
        .iter()
        .filter(|s| s.action != Action::Forward)
        .filter_map(|s| s.key.as_deref())
        .collect();
    let faults = seen.iter().filter(|s| s.action != Action::Forward).count();
    for (key, reply) in &replies {
        let attempts = &per_key[key];
        assert_eq!(
            attempts.len() as u32,
            reply.attempts,
            "the proxy saw every attempt the client counted"
        );
        assert!(
            attempts.windows(2).all(|w| w[0] == w[1]),
            "every retry sends the same body"
        );
        if lost.contains(key.as_str()) {
            assert!(
                reply.replayed,
                "an operation whose answer was lost is answered by a replay"
            );
        }
        assert!(!reply.replayed || reply.attempts > 1, "a replay needs a retry");
    }
    let replays = replies.values().filter(|r| r.replayed).count();
    let fraction = faults as f64 / seen.len() as f64;
    eprintln!(
        "lossy proxy: {} requests for 200 operations, {faults} answers lost ({:.0}%), {} operations hit, {replays} replays reported",
        seen.len(),
        fraction * 100.0,
        lost.len()
    );
    assert!(
        (0.2..0.4).contains(&fraction),
        "the plan loses about 30% of answers: {fraction}"
    );
    assert!(
        replays >= lost.len() && lost.len() >= 40,
        "{replays} replays, {} hit",
        lost.len()
    );
}

#[tokio::test]
async fn a_503_with_retry_after_is_waited_out_and_the_payment_then_succeeds_with_the_same_key() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |incoming| {
        if incoming.elapsed < Duration::from_millis(1_500) {
            Action::Problem {
                status: 503,
                code: "temporarily_unavailable",
                retry_after_secs: Some(1),
            }
        } else {
            Action::Forward
        }
    })
    .await;
    let client = client_for(&proxy.url, &app, fast_config());
    let key = IdempotencyKey::generate();

    let reply = client.pay(100, None, &key).await.expect("succeeds after the window");

    let seen = proxy.seen();
    assert!(seen.len() >= 2 && seen.len() as u32 == reply.attempts, "{seen:?}");
    assert!(
        seen.iter().all(|s| s.key.as_deref() == Some(key.as_str())),
        "one key throughout"
    );
    for pair in seen.windows(2) {
        let gap = pair[1].at - pair[0].at;
        assert!(gap >= Duration::from_millis(990), "the client waited as told: {gap:?}");
    }
    assert_eq!(seen.last().unwrap().status, Some(201));
    assert!(
        !reply.replayed,
        "the server saw the operation once, on the last attempt"
    );
    assert_eq!(app.payment_count().await, 1);
}

#[tokio::test]
async fn refusals_are_returned_at_once_with_the_problem_code_and_never_retried() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |_| Action::Forward).await;
    let client = client_for(&proxy.url, &app, fast_config());
    let reused = IdempotencyKey::generate();
    client.pay(100, None, &reused).await.expect("the first use of the key");
    let stranger = Client::builder(&proxy.url, "not-a-key")
        .config(fast_config())
        .build()
        .unwrap();

    let refusals = [
        (
            client.pay(200, None, &reused).await.map(drop),
            422,
            "idempotency_key_reused",
        ),
        (
            client
                .pay(MAIN_BALANCE + 1, None, &IdempotencyKey::generate())
                .await
                .map(drop),
            402,
            "insufficient_funds",
        ),
        (
            client.pay(0, None, &IdempotencyKey::generate()).await.map(drop),
            400,
            "invalid_request",
        ),
        (client.payment(Uuid::new_v4()).await.map(drop), 404, "not_found"),
        (client.account("nobody").await.map(drop), 404, "account_not_found"),
        (stranger.account("main").await.map(drop), 401, "unauthorized"),
    ];

    for (result, status, code) in refusals {
        let err = result.expect_err(code);
        assert_eq!((err.status(), err.code()), (Some(status), code), "{err}");
        assert!(!err.outcome_unknown(), "a refusal is a final answer: {err}");
    }
    assert_eq!(
        proxy.seen().len(),
        7,
        "one attempt per call, the first payment included"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_409_request_in_progress_is_retried_until_the_first_request_answers() {
    let app = spawn_app_with(|s| s.inflight_wait = Duration::from_millis(300)).await;
    let proxy = FaultProxy::start(&app.address, |_| Action::Forward).await;
    let client = client_for(&proxy.url, &app, fast_config());
    let key = IdempotencyKey::generate();
    let mut lock = lock_main_account(&app).await;
    let original = tokio::spawn({
        let (proxy_client, key) = (client.clone(), key.clone());
        async move { proxy_client.pay(100, None, &key).await }
    });
    blocked_payment_backend(&app, &mut lock).await;

    let duplicate = tokio::spawn({
        let (client, key) = (client.clone(), key.clone());
        async move { client.pay(100, None, &key).await }
    });
    let mut saw_409 = false;
    for _ in 0..100 {
        saw_409 = proxy.seen().iter().any(|s| s.status == Some(409));
        if saw_409 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(saw_409, "the duplicate was answered 409 while the original was held");
    sqlx::query("ROLLBACK").execute(&mut lock).await.unwrap();

    let original = original.await.unwrap().expect("the original completes");
    let duplicate = duplicate.await.unwrap().expect("the duplicate's retry gets the result");
    assert!(!original.replayed && duplicate.replayed);
    assert!(duplicate.attempts >= 2, "{} attempts", duplicate.attempts);
    assert_eq!(
        duplicate.value, original.value,
        "the stored answer, not a second payment"
    );
    assert_eq!(app.payment_count().await, 1);
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
}

#[tokio::test]
async fn every_tenant_endpoint_has_a_typed_call() {
    let app = spawn_app().await;
    let client = client_for(&app.address, &app, fast_config());

    let opened = client
        .open_account("u1", Some(500), &IdempotencyKey::generate())
        .await
        .unwrap();
    let deposit = client.deposit("u1", 250, &IdempotencyKey::generate()).await.unwrap();
    let payment = client.pay(300, Some("u1"), &IdempotencyKey::generate()).await.unwrap();
    let refund = client
        .refund(payment.value.id, &IdempotencyKey::generate())
        .await
        .unwrap();
    let state = client.payment(payment.value.id).await.unwrap();
    client
        .open_account("u2", None, &IdempotencyKey::generate())
        .await
        .unwrap();
    let transfer = client
        .transfer("u1", "u2", 50, &IdempotencyKey::generate())
        .await
        .unwrap();
    let moved = client.get_transfer(transfer.value.id).await.unwrap();
    assert_eq!((transfer.status, moved.value.amount), (201, 50));
    let account = client.account("u1").await.unwrap();
    // Without a processor the top-up calls reach their routes and are refused (501, 404):
    // tests/api/top_ups.rs drives them against one.
    let refused = client
        .top_up(100, "pm_card_visa", Some("u1"), &IdempotencyKey::generate())
        .await
        .unwrap_err();
    assert_eq!(refused.code(), "processor_not_configured");
    let unknown = client.get_top_up(uuid::Uuid::new_v4()).await.unwrap_err();
    assert_eq!(unknown.code(), "not_found");
    let refused = client
        .refund_top_up(uuid::Uuid::new_v4(), &IdempotencyKey::generate())
        .await
        .unwrap_err();
    assert_eq!(refused.code(), "processor_not_configured");
    // Webhooks: register, list, rotate, read an event, delete.
    let endpoint = client
        .create_webhook_endpoint(
            "http://127.0.0.1:9/hooks",
            Some(&["payment.succeeded"]),
            &IdempotencyKey::generate(),
        )
        .await
        .unwrap();
    assert!(endpoint
        .value
        .secret
        .as_deref()
        .is_some_and(|s| s.starts_with("whsec_")));
    let listed = client.webhook_endpoints().await.unwrap();
    assert_eq!(listed.value[0].id, endpoint.value.id);
    let rotated = client
        .rotate_webhook_secret(endpoint.value.id, Some(60), &IdempotencyKey::generate())
        .await
        .unwrap();
    assert_ne!(rotated.value.secret, endpoint.value.secret);
    assert!(rotated.value.secret.is_some());
    let enabled = client
        .enable_webhook_endpoint(endpoint.value.id, &IdempotencyKey::generate())
        .await
        .unwrap();
    assert_eq!(
        (enabled.value.id, enabled.value.status.as_str()),
        (endpoint.value.id, "enabled")
    );
    client.pay(1, Some("u1"), &IdempotencyKey::generate()).await.unwrap();
    let event_id: uuid::Uuid = sqlx::query_scalar("SELECT event_id FROM webhook_events WHERE tenant_id = $1")
        .bind(app.tenant_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let event = client.event(event_id).await.unwrap();
    assert_eq!(event.value.event_type, "payment.succeeded");
    // The event log and its repair (docs/webhooks.md, delivering again): listed, resent,
    // recovered; the attempts listed (none: no worker delivers in this test).
    let events = client.events().list(EventListParams::default()).page().await.unwrap();
    assert_eq!(events.value.data[0].id, event_id);
    let resent = client
        .resend_webhook_event(endpoint.value.id, event_id, &IdempotencyKey::generate())
        .await
        .unwrap();
    assert_eq!((resent.status, resent.value.event_id), (202, event_id));
    let recovered = client
        .recover_webhook_endpoint(endpoint.value.id, chrono::Utc::now(), &IdempotencyKey::generate())
        .await
        .unwrap();
    assert_eq!(
        (recovered.status, recovered.value.endpoint_id),
        (202, endpoint.value.id)
    );
    let attempts = client
        .webhook_attempts(endpoint.value.id, AttemptListParams::default())
        .page()
        .await
        .unwrap();
    assert!(attempts.value.data.is_empty() && !attempts.value.has_more);
    let deleted = client.delete_webhook_endpoint(endpoint.value.id).await.unwrap();
    assert_eq!(deleted.status, 204);
    assert!(client.webhook_endpoints().await.unwrap().value.is_empty());

    assert_eq!((opened.status, opened.value.balance), (201, 500));
    assert_eq!((deposit.status, deposit.value.balance), (201, 750));
    assert_eq!(
        (payment.status, payment.value.charged, payment.value.balance),
        (201, 300, 450)
    );
    assert_eq!(
        (refund.status, refund.value.refunded, refund.value.balance),
        (200, 300, 750)
    );
    assert_eq!((state.value.status.as_str(), state.value.amount), ("refunded", 300));
    let (created_at, refunded_at) = crate::payments::stored_times(&app, payment.value.id).await;
    assert_eq!(
        (state.value.created_at, state.value.refunded_at),
        (created_at, refunded_at)
    );
    assert!(
        refunded_at.is_some_and(|at| at >= created_at),
        "refunded after created: {refunded_at:?}"
    );
    assert_eq!(account.value.balance, 700);
    assert_eq!(app.balance("u1").await, 699);
    // The lists (docs/api.md, lists), each streamed whole, newest first.
    let payments: Vec<_> = client
        .payments()
        .list(PaymentListParams::default())
        .stream()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(payments.len(), 2);
    assert_eq!(payments[1].id, payment.value.id);
    let transfers: Vec<_> = client
        .transfers()
        .list(TransferListParams::default())
        .stream()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(transfers, std::slice::from_ref(&moved.value));
    let top_ups = client.top_ups().list(TopUpListParams::default()).page().await.unwrap();
    assert!(top_ups.value.data.is_empty());
    let accounts: Vec<String> = client
        .accounts()
        .list(ListParams::default())
        .stream()
        .map_ok(|a| a.id)
        .try_collect()
        .await
        .unwrap();
    assert_eq!(accounts, ["u2", "u1", "main"]);
    let key = IdempotencyKey::generate();
    client.pay(5, Some("u1"), &key).await.unwrap();
    let looked_up = client.idempotency_key(&key).await.unwrap();
    assert_eq!(
        (looked_up.value.status, looked_up.value.operation.as_str()),
        (Some(201), "create_payment")
    );

    // Every documented tenant endpoint was reached through a typed call: the server counts
    // requests by route template, and only this client called it.
    let metrics = app.metrics().await;
    let reached: HashSet<&str> = metrics
        .lines()
        .filter(|line| line.starts_with("oncepay_requests_total{") && !line.ends_with(" 0"))
        .filter_map(|line| line.split("route=\"").nth(1)?.split('"').next())
        .collect();
    for (method, template) in tenant_endpoints() {
        // `POST /pay` is the alias of `POST /payments`: the same typed call.
        if template != "/pay" {
            assert!(
                reached.contains(template.as_str()),
                "{method} {template} has no typed call: {reached:?}"
            );
        }
    }
    let err = client.deposit("a/b", 1, &IdempotencyKey::generate()).await.unwrap_err();
    assert_eq!(err.code(), "invalid_request", "a path id is encoded, not split: {err}");
    assert!(matches!(err, ClientError::Problem(_)));
}
