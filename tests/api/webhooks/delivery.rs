//! Delivery through a receiver's faults: every committed change's event arrives, signed, once
//! acknowledged; a duplicate carries the same `webhook-id`; per resource in order; the
//! receiver down then back, 500 then 200, an answer lost after the receiver processed it,
//! 410, a schedule spent, `Retry-After`, three replicas at once, an endpoint at its bound.

use std::time::{Duration, Instant};

use serde_json::json;
use uuid::Uuid;

use super::{all_delivered, committed, delivering, delivering_app, event_count, pay, refund, subscribe, WAIT};
use crate::support::helpers::{drop_database, metric_value, new_key, spawn_app_on_own_database_with, TestApp};
use crate::support::webhook_receiver::{Receiver, Reply};

#[tokio::test]
async fn every_committed_change_arrives_signed_in_order_and_no_replay_decline_or_rollback_emits() {
    let app = delivering_app().await;
    let receiver = Receiver::start().await;
    subscribe(&app, &receiver, None).await;
    app.open_account("a", 1_000).await;
    app.open_account("b", 0).await;

    let key = new_key();
    let paid = app.pay(Some(&key), 100).await;
    let payment = paid.body["id"].as_str().unwrap().to_owned();
    assert!(app.pay(Some(&key), 100).await.replayed());
    refund(&app, &payment).await;
    let declined = app.pay(Some(&new_key()), 1_000_000).await;
    declined.assert_problem(402, "insufficient_funds");
    let deposit = app.deposit(Some(&new_key()), "a", 50).await;
    assert_eq!(deposit.status, 201);
    let transfer = app.transfer(Some(&new_key()), "a", "b", 25).await;
    assert_eq!(transfer.status, 201);

    // A change rolled back: its function ran (and emitted) inside a transaction that aborts.
    let mut tx = app.pool.begin().await.unwrap();
    let rolled_back: Uuid = sqlx::query_scalar(
        "SELECT (resource).payment_id FROM oncepay_pay($1, ROW(NULL, false, NULL, 'pay', 'POST', '/payments', 0, 1000, 201, '{}')::oncepay_claim_args, 'main', 7)",
    )
    .bind(app.tenant_id)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();

    let report = all_delivered(&app, &receiver).await;
    assert_eq!(report.events, 4, "{report:?}");
    let messages = receiver.messages();
    assert!(messages.iter().all(|m| m.resource != rolled_back.to_string()));

    // The bodies: {"type","timestamp","data"}, data as the resource's GET (or answer).
    let of = |t: &str| messages.iter().find(|m| m.event_type == t).unwrap().clone();
    let succeeded = of("payment.succeeded");
    assert_eq!(succeeded.body["data"]["id"], payment);
    assert_eq!(succeeded.body["data"]["amount"], 100);
    assert_eq!(succeeded.body["data"]["status"], "succeeded");
    assert_eq!(succeeded.body["data"]["account"], "main");
    let refunded = of("payment.refunded");
    assert_eq!(refunded.body["data"]["status"], "refunded");
    assert!(refunded.body["data"]["refunded_at"].is_string());
    assert_eq!(of("deposit.succeeded").body["data"]["balance"], deposit.body["balance"]);
    assert_eq!(of("transfer.succeeded").body["data"]["from"], "a");
    let headers = &succeeded.headers;
    assert_eq!(headers["webhook-id"], succeeded.id);
    assert!(headers["webhook-signature"].starts_with("v1,"));
    let ts: i64 = headers["webhook-timestamp"].parse().unwrap();
    assert!((chrono::Utc::now().timestamp() - ts).abs() < 60);

    // GET /events/{id} answers the event as delivered.
    let event = app.get(&format!("/events/{}", succeeded.id)).await;
    assert_eq!(event.status, 200);
    assert_eq!(event.body["type"], succeeded.body["type"]);
    assert_eq!(event.body["timestamp"], succeeded.body["timestamp"]);
    assert_eq!(event.body["data"], succeeded.body["data"]);
    let stranger = TestApp::builder().spawn().await;
    stranger
        .get(&format!("/events/{}", succeeded.id))
        .await
        .assert_problem(404, "not_found");

    // Each attempt is recorded: status, latency, the answer's first bytes.
    let (status, head): (Option<i16>, Option<String>) = sqlx::query_as(
        "SELECT status, response_head FROM webhook_attempts WHERE tenant_id = $1 AND event_id = $2::uuid",
    )
    .bind(app.tenant_id)
    .bind(&succeeded.id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((status, head.as_deref()), (Some(200), Some("ok")));
}

#[tokio::test]
async fn a_receiver_down_then_back_gets_every_event() {
    let app = delivering_app().await;
    let receiver = Receiver::unstarted().await;
    subscribe(&app, &receiver, None).await;
    let mut payments = Vec::new();
    for _ in 0..10 {
        payments.push(pay(&app, 10).await);
    }
    for payment in &payments[..5] {
        refund(&app, payment).await;
    }
    // Refused connections, attempt after attempt.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let failed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_attempts WHERE tenant_id = $1 AND status IS NULL AND error IS NOT NULL",
    )
    .bind(app.tenant_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(failed >= 10, "{failed} failed attempts recorded");
    receiver.start_again().await;
    let report = all_delivered(&app, &receiver).await;
    assert_eq!(report.events, 15, "{report:?}");
}

#[tokio::test]
async fn a_receiver_answering_500_then_200_gets_each_event_again_with_its_id_in_order() {
    let app = delivering_app().await;
    let receiver = Receiver::start().await;
    receiver.script(|m| {
        if m.nth <= 2 {
            Reply::Status(500)
        } else {
            Reply::Status(200)
        }
    });
    subscribe(&app, &receiver, None).await;
    for _ in 0..5 {
        let payment = pay(&app, 10).await;
        refund(&app, &payment).await;
    }
    let report = all_delivered(&app, &receiver).await;
    assert_eq!(report.events, 10);
    assert!(report.duplicates >= 20, "{report:?}");
}

#[tokio::test]
async fn an_answer_lost_after_the_receiver_processed_it_is_resent_with_the_same_id() {
    let app = delivering_app().await;
    let receiver = Receiver::start().await;
    receiver.script(|m| if m.nth == 1 { Reply::Close } else { Reply::Status(200) });
    subscribe(&app, &receiver, None).await;
    for _ in 0..5 {
        pay(&app, 10).await;
    }
    let report = all_delivered(&app, &receiver).await;
    assert_eq!(report.events, 5);
    assert!(report.duplicates >= 5, "{report:?}");
}

/// 410 Gone disables the endpoint at once, its delivery kept (held) for when it is enabled
/// again; a message that fails the whole schedule is given up, that message alone: its
/// endpoint stays enabled (tests/api/webhooks/hardening.rs has the endpoint that keeps failing
/// for the disable-after, and the enabling). On a database of its own, so that its attempts
/// are all this replica's: on the shared one a replica of another test may claim a retry, on
/// its own schedule, and leave it unrecorded when its test ends.
#[tokio::test]
async fn gone_disables_the_endpoint_and_a_spent_schedule_gives_up_the_message_alone() {
    let (app, url) = spawn_app_on_own_database_with("gone", |s| {
        delivering(s);
        s.webhooks.retry_schedule = vec![Duration::from_millis(100), Duration::from_millis(100)];
    })
    .await;
    let gone = Receiver::start().await;
    gone.script(|_| Reply::Status(410));
    let failing = Receiver::start().await;
    failing.script(|_| Reply::Status(500));
    let gone_id = subscribe(&app, &gone, None).await;
    let failing_id = subscribe(&app, &failing, None).await;
    pay(&app, 10).await;

    let deadline = Instant::now() + WAIT;
    let states = loop {
        let states: Vec<(Uuid, String, Option<String>)> = sqlx::query_as(
            "SELECT e.endpoint_id, d.state, e.disabled_reason FROM webhook_deliveries d
               JOIN webhook_endpoints e USING (tenant_id, endpoint_id) WHERE d.tenant_id = $1 ORDER BY 1",
        )
        .bind(app.tenant_id)
        .fetch_all(&app.pool)
        .await
        .unwrap();
        // Both deliveries written (by the fan-out, after the payment) and settled.
        if (states.len() == 2 && states.iter().all(|(_, state, _)| state != "pending")) || Instant::now() > deadline {
            break states;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(states.len(), 2, "{states:?}");
    for (endpoint, state, reason) in &states {
        if endpoint.to_string() == gone_id {
            assert_eq!((state.as_str(), reason.as_deref()), ("held", Some("gone")));
        } else {
            assert_eq!(endpoint.to_string(), failing_id);
            assert_eq!((state.as_str(), reason.as_deref()), ("given_up", None));
        }
    }
    // 410 is not retried: the attempt answered 410 is the delivery's last. An attempt before
    // it may have failed in transport, its answer unread (a request past the 2 s timeout on
    // a loaded machine, say): that retry is the schedule's, not the 410's. The receiver once
    // counted two requests here (a test-pgbouncer run; its attempts were not kept), which the
    // former check, one request exactly, could not tell from a retried 410.
    let attempts: Vec<(Option<i16>,)> = sqlx::query_as(
        "SELECT status FROM webhook_attempts WHERE tenant_id = $1 AND endpoint_id = $2::uuid ORDER BY attempt",
    )
    .bind(app.tenant_id)
    .bind(&gone_id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(attempts.last(), Some(&(Some(410),)), "{attempts:?}");
    assert!(
        attempts[..attempts.len() - 1].iter().all(|(status,)| status.is_none()),
        "an answer before the 410 was retried: {attempts:?}"
    );
    let messages = gone.messages();
    assert!(
        !messages.is_empty() && messages.len() <= attempts.len(),
        "{} requests for {} attempts",
        messages.len(),
        attempts.len()
    );
    assert!(messages.iter().all(|m| m.id == messages[0].id));
    // The first attempt and one per wait of the schedule.
    assert_eq!(failing.messages().len(), 3, "attempts");
    assert!(failing.messages().iter().all(|m| m.id == failing.messages()[0].id));
    let listed = app.get("/webhook-endpoints").await.body;
    let status_of = |id: &str| {
        listed
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["id"] == id)
            .map(|e| e["status"].clone())
    };
    assert_eq!(status_of(&gone_id), Some(json!("disabled")), "{listed}");
    assert_eq!(status_of(&failing_id), Some(json!("enabled")), "{listed}");
    // The gauges of disabled endpoints and of the deliveries held for them (the 410's own)
    // are read from the database, refreshed every 5 s.
    let gauges = || async {
        let exposition = app.metrics().await;
        (
            metric_value(&exposition, "oncepay_webhook_endpoints_disabled"),
            metric_value(&exposition, "oncepay_webhook_held_deliveries"),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (disabled, held) = gauges().await;
        if disabled >= 1.0 && held >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "oncepay_webhook_endpoints_disabled = {disabled}, oncepay_webhook_held_deliveries = {held}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A disabled endpoint is sent nothing new; the enabled one gets the next event.
    let sent_to_gone = gone.messages().len();
    let sent_to_failing = failing.messages().len();
    pay(&app, 10).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(gone.messages().len(), sent_to_gone);
    assert!(failing.messages().len() > sent_to_failing);
    // Its delivery to the disabled endpoint is held, and counted.
    let deadline = Instant::now() + Duration::from_secs(15);
    while gauges().await.1 < 2.0 {
        assert!(Instant::now() < deadline, "held deliveries: {:?}", gauges().await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(app);
    drop_database(&url).await;
}

/// On a database of its own: a delivering server of another test process (another schedule:
/// `Retry-After` is capped at the longest wait of the schedule of whoever attempts) could
/// otherwise take the retry.
#[tokio::test]
async fn retry_after_on_503_is_honoured() {
    let (app, url) = spawn_app_on_own_database_with("retry_after", delivering).await;
    let receiver = Receiver::start().await;
    receiver.script(|m| {
        if m.nth == 1 {
            Reply::RetryAfter(503, 2)
        } else {
            Reply::Status(200)
        }
    });
    subscribe(&app, &receiver, None).await;
    pay(&app, 10).await;
    all_delivered(&app, &receiver).await;
    let messages = receiver.messages();
    assert_eq!(messages.len(), 2);
    let gap = messages[1].at - messages[0].at;
    // The schedule's first wait is 0.2 s; Retry-After asked for 2.
    assert!(gap >= Duration::from_millis(1_900), "{gap:?}");
    drop_database(&url).await;
}

/// Three replicas deliver at once, each claiming from the same tables, while the payments
/// and refunds arrive concurrently on all three: every event arrives (none skipped under
/// concurrent writers), duplicates only with their id, in order per payment, and never more
/// attempts in flight to the endpoint than its bound.
#[tokio::test]
async fn three_replicas_deliver_every_event_with_bounded_concurrency_per_endpoint() {
    let apps = TestApp::builder().settings(delivering).spawn_instances(3).await;
    let receiver = Receiver::start().await;
    // Some answers lost, some 500s: retries run on whichever replica claims them.
    receiver.script(|m| match (m.nth, m.id.as_bytes()[0] % 4) {
        (1, 0) => Reply::Status(500),
        (1, 1) => Reply::Close,
        _ => Reply::Status(200),
    });
    // Slow answers, so that attempts overlap and the bound is what limits them.
    receiver.set_delay(Duration::from_millis(100));
    subscribe(&apps[0], &receiver, None).await;
    apps[0].deposit(Some(&new_key()), "main", 1_000_000).await;
    let mut tasks = Vec::new();
    for i in 0..60 {
        let app = apps[i % 3].clone();
        tasks.push(tokio::spawn(async move {
            let payment = pay(&app, 10).await;
            if i % 3 == 0 {
                refund(&app, &payment).await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let report = all_delivered(&apps[0], &receiver).await;
    assert_eq!(report.events, 60 + 20 + 1, "{report:?}");
    let bound = apps[0].state.settings.webhooks.endpoint_concurrency as usize;
    assert_eq!(
        receiver.max_in_flight(),
        bound,
        "attempts in flight at once to the endpoint"
    );
    let replicas: i64 = sqlx::query_scalar("SELECT count(DISTINCT replica) FROM webhook_attempts WHERE tenant_id = $1")
        .bind(apps[0].tenant_id)
        .fetch_one(&apps[0].pool)
        .await
        .unwrap();
    println!("three replicas: {} messages for {} events, {} duplicates, max in flight {}, replicas that attempted {replicas}", report.messages, report.events, report.duplicates, receiver.max_in_flight());
}

/// An endpoint at its bound gets its next event as soon as one of its attempts ends, not a
/// poll later. One attempt in flight allowed, a poll of two minutes, twelve events waiting
/// when the only delivering replica starts: they all arrive, in order, one at a time, long
/// before a single poll would have passed (were each to wait for the poll, they would take
/// twenty-four minutes). On a database of its own, so that no other test's replica delivers
/// them.
#[tokio::test]
async fn an_endpoint_at_its_bound_gets_its_next_event_when_an_attempt_ends_not_a_poll_later() {
    let (writer, url) = crate::support::helpers::spawn_app_on_own_database("webhook_bound").await;
    let receiver = Receiver::start().await;
    subscribe(&writer, &receiver, None).await;
    for _ in 0..12 {
        pay(&writer, 10).await;
    }
    let poll = Duration::from_secs(120);
    let started = Instant::now();
    let _deliverer = TestApp::builder()
        .tenant_of(&writer)
        .settings(|s| {
            s.database_url = crate::support::helpers::server_url(&url);
            s.webhooks.concurrency = 16;
            s.webhooks.endpoint_concurrency = 1;
            s.webhooks.poll = poll;
        })
        .spawn()
        .await;
    let expected = committed(&writer).await;
    receiver.wait_for_acknowledged(event_count(&expected), poll / 2).await;
    let took = started.elapsed();
    let report = receiver.check(&expected);
    assert_eq!(report.events, 12, "{report:?}");
    assert_eq!(report.duplicates, 0, "{report:?}");
    assert_eq!(receiver.max_in_flight(), 1, "the endpoint's bound");
    assert!(took < poll / 2, "twelve events took {took:?}");
    crate::support::helpers::drop_database(&url).await;
}

/// An attempt that got no answer says why in the attempts list: one past the timeout says so
/// in oncepay's words, whichever timer fired first (found from outside: reqwest's own timer
/// usually fires a moment before ours, and the list showed its error chain, "error sending
/// request for url (...): operation timed out"), also when the connection never opens, and a
/// refused connection says it was refused. On a database of its own, so that every attempt is this replica's (another
/// test's replica would time out after its own timeout).
#[tokio::test]
async fn an_attempt_without_an_answer_says_why() {
    let (app, url) = spawn_app_on_own_database_with("attempt_errors", |s| {
        delivering(s);
        s.webhooks.timeout = Duration::from_millis(300);
    })
    .await;
    let failed = |app: &TestApp, endpoint: &str| {
        let (app, path) = (
            app.clone(),
            format!("/webhook-endpoints/{endpoint}/attempts?outcome=failed&limit=100"),
        );
        async move { app.get(&path).await.body["data"].as_array().unwrap().clone() }
    };

    let slow = Receiver::start().await;
    slow.set_delay(Duration::from_secs(3));
    let endpoint = subscribe(&app, &slow, None).await;
    pay(&app, 10).await;
    super::wait_until("two attempts time out", WAIT, || async {
        failed(&app, &endpoint).await.len() >= 2
    })
    .await;
    slow.set_delay(Duration::ZERO);
    for attempt in failed(&app, &endpoint).await {
        assert_eq!(attempt["status"], serde_json::Value::Null, "{attempt}");
        assert_eq!(attempt["error"], "no answer within 300 ms", "{attempt}");
    }

    let down = Receiver::unstarted().await;
    let endpoint = subscribe(&app, &down, None).await;
    pay(&app, 10).await;
    super::wait_until("an attempt is refused", WAIT, || async {
        !failed(&app, &endpoint).await.is_empty()
    })
    .await;
    for attempt in failed(&app, &endpoint).await {
        let error = attempt["error"].as_str().unwrap();
        assert!(error.contains("refused"), "{attempt}");
    }

    // A receiver whose accept queue is full: the handshake never completes.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let full = socket.listen(1).unwrap();
    let address = full.local_addr().unwrap();
    let mut queued = Vec::new();
    while let Ok(stream) = std::net::TcpStream::connect_timeout(&address, Duration::from_millis(200)) {
        queued.push(stream);
        assert!(queued.len() < 64, "the accept queue never filled");
    }
    let answer = app
        .post(
            "/webhook-endpoints",
            Some(&new_key()),
            &json!({ "url": format!("http://{address}/hooks") }),
        )
        .await;
    assert_eq!(answer.status, 201, "{}", answer.body);
    let endpoint = answer.body["id"].as_str().unwrap().to_owned();
    pay(&app, 10).await;
    super::wait_until("an attempt gets no connection", WAIT, || async {
        !failed(&app, &endpoint).await.is_empty()
    })
    .await;
    for attempt in failed(&app, &endpoint).await {
        assert_eq!(attempt["error"], "no answer within 300 ms", "{attempt}");
    }
    drop((full, queued));
    drop_database(&url).await;
}
