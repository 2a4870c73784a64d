//! Card top-ups against a real processor emulator (localstripe), with this suite's own fault
//! proxy between oncepay and it, and real `kill -9` of an oncepay process between phases.
//! Every scenario checks the four promises of docs/top-ups.md: at most one succeeded
//! PaymentIntent per top-up (listed at localstripe by its metadata), the balance credited
//! exactly once iff one succeeded, the client's retries with the same key ending on the final
//! answer, and `oncepay audit` (reading localstripe's PaymentIntents) clean.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oncepay::config::{Processor, Settings};
use serde_json::{json, Value};
use tokio::process::{Child, Command};

use crate::stripe_rules::StripeRules;
use crate::support::fault_proxy::{Action, FaultProxy, Incoming};
use crate::support::helpers::{database_url, new_key, server_url, Answer, TestApp, MAIN_BALANCE};
use crate::support::stripe::{Localstripe, API_KEY};

pub(crate) const TIMEOUT: Duration = Duration::from_millis(1_000);
pub(crate) const AMOUNT: i64 = 5_000;
pub(crate) const VISA: &str = "pm_card_visa";
/// localstripe's card 4000000000000341: created fine, declined when confirmed.
pub(crate) const DECLINED: &str = "pm_card_chargeCustomerFail";

/// Which processor call a fault hits.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Call {
    Create,
    Confirm,
    Refund,
}

impl Call {
    pub(crate) fn matches(self, incoming: &Incoming) -> bool {
        let path = incoming.path.split('?').next().unwrap_or_default();
        incoming.method == "POST"
            && match self {
                Self::Create => path == "/v1/payment_intents",
                Self::Confirm => path.ends_with("/confirm"),
                Self::Refund => path == "/v1/refunds",
            }
    }
}

/// A plan that applies `action` to the first `times` requests of `call`, and forwards the rest.
pub(crate) fn first(call: Call, times: usize, action: Action) -> impl Fn(&Incoming) -> Action + Send + Sync + 'static {
    let hit = Arc::new(AtomicUsize::new(0));
    move |incoming: &Incoming| {
        if call.matches(incoming) && hit.fetch_add(1, Ordering::SeqCst) < times {
            action.clone()
        } else {
            Action::Forward
        }
    }
}

/// The processor's name in a test: one per processor (per proxy), so that no test's completer
/// takes another test's top-ups (they share the database, not the processor).
pub(crate) fn processor_name(url: &str) -> String {
    format!("test-{url}")
}

pub(crate) fn with_processor(settings: &mut Settings, url: &str) {
    settings.processor = Some(Processor {
        url: url.to_owned(),
        api_key: Some(API_KEY.to_owned()),
        timeout: TIMEOUT,
        name: processor_name(url),
    });
    // Off unless a test turns it on: the client's retries alone must finish the top-up.
    settings.completer_after = Duration::from_secs(3_600);
}

pub(crate) struct Rig {
    pub(crate) stripe: Localstripe,
    pub(crate) proxy: FaultProxy,
    pub(crate) app: TestApp,
}

/// localstripe, the fault proxy in front of it with Stripe's rules (`crate::stripe_rules`),
/// and an app whose processor is the proxy.
pub(crate) async fn rig(
    plan: impl Fn(&Incoming) -> Action + Send + Sync + 'static,
    adjust: impl FnOnce(&mut Settings),
) -> Rig {
    rig_with(StripeRules::default(), plan, adjust).await
}

pub(crate) async fn rig_with(
    rules: StripeRules,
    plan: impl Fn(&Incoming) -> Action + Send + Sync + 'static,
    adjust: impl FnOnce(&mut Settings),
) -> Rig {
    let stripe = Localstripe::start().await;
    let proxy = FaultProxy::start_stripe(&stripe.url, rules, plan).await;
    let url = proxy.url.clone();
    let app = TestApp::builder()
        .settings(|s| {
            with_processor(s, &url);
            adjust(s);
        })
        .spawn()
        .await;
    Rig { stripe, proxy, app }
}

impl TestApp {
    pub(crate) async fn top_up(&self, key: &str, account: &str, amount: i64, payment_method: &str) -> Answer {
        self.post(
            &format!("/accounts/{account}/top-ups"),
            Some(key),
            &json!({ "amount": amount, "payment_method": payment_method }),
        )
        .await
    }

    pub(crate) async fn refund_top_up(&self, key: &str, id: &str) -> Answer {
        self.post(&format!("/top-ups/{id}/refund"), Some(key), &json!({})).await
    }

    /// The top-up made under `key` (read from the database: its request may have died).
    pub(crate) async fn top_up_of_key(&self, key: &str) -> Option<(String, String)> {
        sqlx::query_as::<_, (uuid::Uuid, String)>(
            "SELECT top_up_id, status FROM top_ups WHERE tenant_id = $1 AND idempotency_key = $2",
        )
        .bind(self.tenant_id)
        .bind(key)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
        .map(|(id, status)| (id.to_string(), status))
    }
}

/// The client's retries with one key until a final answer (not 503, not 409); gives every
/// answer in order.
pub(crate) async fn retry_until_final(send: impl AsyncFn() -> Answer) -> Vec<Answer> {
    let mut answers = Vec::new();
    for _ in 0..40 {
        let answer = send().await;
        let transient = matches!(answer.status, 503 | 409);
        if transient {
            assert!(
                answer.header("retry-after").is_some(),
                "a {} without Retry-After: {}",
                answer.status,
                answer.body
            );
        }
        answers.push(answer);
        if !transient {
            return answers;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!(
        "no final answer after 40 attempts: {:?}",
        answers.last().map(|a| &a.body)
    );
}

/// `oncepay audit --json` of the app's tenant, reconciling with the processor at `stripe`.
pub(crate) async fn audit(app: &TestApp, stripe: &Localstripe) -> Value {
    audit_of(app.tenant_id, stripe).await
}

/// [`audit`] of `tenant`.
pub(crate) async fn audit_of(tenant: uuid::Uuid, stripe: &Localstripe) -> Value {
    let output = Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .args(["audit", "--json", "--tenant", &tenant.to_string()])
        .env("DATABASE_URL", database_url())
        .env("ONCEPAY_PROCESSOR_URL", &stripe.url)
        .env("ONCEPAY_PROCESSOR_API_KEY", API_KEY)
        .output()
        .await
        .unwrap();
    serde_json::from_slice(&output.stdout).unwrap_or_else(|_| {
        panic!(
            "no audit report: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// The promises: at most one succeeded PaymentIntent, `expect_charged` of them; the balance
/// credited exactly that often; the top-up's state; the audit clean.
pub(crate) async fn assert_exactly_once(app: &TestApp, stripe: &Localstripe, top_up: &str, expect_charged: bool) {
    let succeeded = stripe.succeeded_of(top_up).await;
    assert!(succeeded <= 1, "top-up {top_up}: {succeeded} succeeded PaymentIntents");
    assert_eq!(
        succeeded,
        usize::from(expect_charged),
        "top-up {top_up} charged? its PaymentIntents: {:#?}",
        stripe.intents_of(top_up).await
    );
    assert_eq!(
        app.balance("main").await,
        MAIN_BALANCE + AMOUNT * succeeded as i64,
        "credited exactly once iff charged"
    );
    let state = app.get(&format!("/top-ups/{top_up}")).await;
    assert_eq!(state.status, 200);
    assert_eq!(
        state.body["status"],
        if expect_charged { "succeeded" } else { "failed" }
    );
    if expect_charged {
        let intent = state.body["processor_payment_id"].as_str().unwrap();
        let of_top_up = stripe.intents_of(top_up).await;
        let succeeded = of_top_up.iter().find(|i| i["status"] == "succeeded").unwrap();
        assert_eq!(succeeded["id"], intent, "the top-up names its charged PaymentIntent");
        assert_eq!(succeeded["amount"], AMOUNT);
    }
    let report = audit(app, stripe).await;
    assert_eq!(report["clean"], true, "audit: {report:#}");
    assert_eq!(report["invariants"]["top_ups"]["count"], 0, "{report:#}");
    assert!(report["checked"]["processor_intents"].as_i64().unwrap() >= 1);
}

#[tokio::test]
async fn a_top_up_charges_the_card_once_credits_once_and_replays() {
    let Rig { stripe, proxy, app } = rig(|_: &Incoming| Action::Forward, |_| {}).await;
    let key = new_key();
    let first = app.top_up(&key, "main", AMOUNT, VISA).await;
    assert_eq!(first.status, 201, "{}", first.body);
    assert_eq!(first.header("idempotency-replayed"), Some("false"));
    let id = first.body["id"].as_str().unwrap().to_owned();
    assert_eq!(first.header("location"), Some(format!("/top-ups/{id}").as_str()));
    assert_eq!(first.body["status"], "succeeded");
    assert_eq!(first.body["amount"], AMOUNT);
    assert_eq!(first.body["currency"], "usd");
    assert_eq!(first.body["account"], "main");
    assert_eq!(first.body["balance"], MAIN_BALANCE + AMOUNT);
    assert!(first.body["processor_payment_id"].as_str().unwrap().starts_with("pi_"));

    let replay = app.top_up(&key, "main", AMOUNT, VISA).await;
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    let reused = app.top_up(&key, "main", AMOUNT + 1, VISA).await;
    reused.assert_problem(422, "idempotency_key_reused");

    // Every call carried an Idempotency-Key of oncepay's own, never the client's.
    let seen = proxy.seen();
    assert_eq!(seen.len(), 2, "create and confirm, nothing for the replays: {seen:?}");
    for call in &seen {
        let derived = call.key.as_deref().unwrap();
        assert!(derived.contains(&id) && !derived.contains(&key), "{derived}");
    }
    assert_eq!(
        stripe.intents_of(&id).await[0]["metadata"]["oncepay_top_up_id"],
        id.as_str()
    );
    assert_exactly_once(&app, &stripe, &id, true).await;

    // Another tenant sees nothing of it.
    let other = TestApp::builder()
        .settings(|s| with_processor(s, &proxy.url))
        .spawn()
        .await;
    other
        .get(&format!("/top-ups/{id}"))
        .await
        .assert_problem(404, "not_found");
}

#[tokio::test]
async fn declines_and_invalid_payment_methods_are_stored_and_replayed() {
    let Rig {
        stripe,
        app,
        proxy: _proxy,
    } = rig(|_: &Incoming| Action::Forward, |_| {}).await;
    let key = new_key();
    let declined = app.top_up(&key, "main", AMOUNT, DECLINED).await;
    declined.assert_problem(402, "card_declined");
    assert_eq!(declined.body["decline_code"], "card_declined");
    assert!(!declined.replayed());
    let again = app.top_up(&key, "main", AMOUNT, DECLINED).await;
    again.assert_problem(402, "card_declined");
    assert!(again.replayed());
    assert_eq!(again.body, declined.body);
    let (id, status) = app.top_up_of_key(&key).await.unwrap();
    assert_eq!(status, "failed");
    assert_exactly_once(&app, &stripe, &id, false).await;
    // What the processor holds of the declined PaymentIntent, as its refusal said.
    let shown = app.get(&format!("/top-ups/{id}")).await;
    assert_eq!(
        shown.body["processor_status"], "requires_payment_method",
        "{}",
        shown.body
    );

    let invalid_key = new_key();
    let invalid = app.top_up(&invalid_key, "main", AMOUNT, "pm_no_such_method").await;
    invalid.assert_problem(400, "invalid_payment_method");
    let again = app.top_up(&invalid_key, "main", AMOUNT, "pm_no_such_method").await;
    again.assert_problem(400, "invalid_payment_method");
    assert!(again.replayed());
    assert_eq!(app.balance("main").await, MAIN_BALANCE);

    // An unknown account is a stored 404 decided before the processor is asked.
    let before = stripe.intents().await.len();
    let key = new_key();
    app.top_up(&key, "nobody", AMOUNT, VISA)
        .await
        .assert_problem(404, "account_not_found");
    assert!(app.top_up(&key, "nobody", AMOUNT, VISA).await.replayed());
    assert_eq!(stripe.intents().await.len(), before);
    // Malformed requests are refused before anything is claimed.
    app.top_up(&new_key(), "main", 0, VISA)
        .await
        .assert_problem(400, "invalid_request");
    app.top_up(&new_key(), "main", AMOUNT, "pm with space")
        .await
        .assert_problem(400, "invalid_request");
}

#[tokio::test]
async fn without_a_processor_top_ups_answer_501() {
    let app = TestApp::builder().spawn().await;
    let answer = app.top_up(&new_key(), "main", AMOUNT, VISA).await;
    answer.assert_problem(501, "processor_not_configured");
    assert_eq!(app.key_count().await, 0, "nothing claimed");
}

/// A fault on one call of a top-up: the first answer is 503 with Retry-After, the client's
/// retries with the same key end on 201, not marked replayed; the next retry replays it.
async fn fault_scenario(call: Call, action: Action) {
    let Rig { stripe, proxy, app } = rig(first(call, 1, action.clone()), |_| {}).await;
    let key = new_key();
    let answers = retry_until_final(async || app.top_up(&key, "main", AMOUNT, VISA).await).await;
    assert!(
        answers.len() >= 2 && answers[0].status == 503,
        "{action:?} on {call:?}: the first answer is 503, got {:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    answers[0].assert_problem(503, "temporarily_unavailable");
    let last = answers.last().unwrap();
    assert_eq!(last.status, 201, "{action:?} on {call:?}: {}", last.body);
    assert!(!last.replayed(), "the first final answer is not a replay");
    let replay = app.top_up(&key, "main", AMOUNT, VISA).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, last.body);
    let id = last.body["id"].as_str().unwrap().to_owned();
    // A held request reaches the processor late: let it, before counting charges.
    tokio::time::sleep(TIMEOUT).await;
    assert_exactly_once(&app, &stripe, &id, true).await;
    assert!(
        proxy.seen().iter().any(|s| s.action == action),
        "the fault was injected"
    );
}

#[tokio::test]
async fn a_refused_confirmation_is_resumed() {
    fault_scenario(Call::Confirm, Action::Refuse).await;
}

#[tokio::test]
async fn a_confirmation_held_past_the_timeout_is_resumed_without_a_second_charge() {
    fault_scenario(Call::Confirm, Action::HoldRequest(TIMEOUT + Duration::from_millis(700))).await;
}

#[tokio::test]
async fn a_confirmation_answered_after_the_timeout_is_resumed() {
    fault_scenario(Call::Confirm, Action::DelayAnswer(TIMEOUT + Duration::from_millis(700))).await;
}

#[tokio::test]
async fn a_confirmation_whose_answer_is_lost_is_resumed() {
    fault_scenario(Call::Confirm, Action::DropAnswer).await;
}

#[tokio::test]
async fn a_500_before_the_confirmation_reached_the_processor_is_resumed() {
    fault_scenario(Call::Confirm, Action::PlainError { status: 500 }).await;
}

#[tokio::test]
async fn a_500_after_the_processor_charged_is_resumed() {
    fault_scenario(Call::Confirm, Action::ForwardThenStatus(500)).await;
}

#[tokio::test]
async fn a_created_payment_intent_whose_answer_is_lost_is_never_confirmed() {
    fault_scenario(Call::Create, Action::DropAnswer).await;
}

#[tokio::test]
async fn a_500_after_the_payment_intent_was_created_is_resumed() {
    fault_scenario(Call::Create, Action::ForwardThenStatus(500)).await;
}

#[tokio::test]
async fn a_refused_creation_is_resumed() {
    fault_scenario(Call::Create, Action::Refuse).await;
}

#[tokio::test]
async fn a_decline_whose_answer_is_lost_is_answered_as_the_decline() {
    let Rig {
        stripe,
        app,
        proxy: _proxy,
    } = rig(first(Call::Confirm, 1, Action::DropAnswer), |_| {}).await;
    let key = new_key();
    let answers = retry_until_final(async || app.top_up(&key, "main", AMOUNT, DECLINED).await).await;
    assert_eq!(answers[0].status, 503);
    let last = answers.last().unwrap();
    last.assert_problem(402, "card_declined");
    assert!(!last.replayed());
    assert!(app.top_up(&key, "main", AMOUNT, DECLINED).await.replayed());
    let (id, _) = app.top_up_of_key(&key).await.unwrap();
    assert_exactly_once(&app, &stripe, &id, false).await;
}

#[tokio::test]
async fn a_refund_debits_first_and_refunds_once_across_a_lost_answer() {
    let Rig { stripe, proxy, app } = rig(first(Call::Refund, 1, Action::DropAnswer), |_| {}).await;
    let created = app.top_up(&new_key(), "main", AMOUNT, VISA).await;
    assert_eq!(created.status, 201);
    let id = created.body["id"].as_str().unwrap().to_owned();
    let intent = created.body["processor_payment_id"].as_str().unwrap().to_owned();

    let key = new_key();
    let answers = retry_until_final(async || app.refund_top_up(&key, &id).await).await;
    assert_eq!(answers[0].status, 503, "{}", answers[0].body);
    let last = answers.last().unwrap();
    assert_eq!(last.status, 200, "{}", last.body);
    assert_eq!(
        last.body,
        json!({"id": id, "status": "refunded", "refunded": AMOUNT, "balance": MAIN_BALANCE})
    );
    assert!(!last.replayed());
    assert!(app.refund_top_up(&key, &id).await.replayed());
    app.refund_top_up(&new_key(), &id)
        .await
        .assert_problem(409, "already_refunded");
    assert_eq!(
        stripe.refunds_of(&intent).await.len(),
        1,
        "refunded once at the processor"
    );
    assert_eq!(app.balance("main").await, MAIN_BALANCE, "debited once");
    assert_eq!(app.get(&format!("/top-ups/{id}")).await.body["status"], "refunded");
    // The retry looked first (GET, the lost refund was made) and refunded nothing more.
    let seen = proxy.seen();
    assert_eq!(seen.iter().filter(|s| s.path == "/v1/refunds").count(), 1, "{seen:?}");
    assert!(seen.iter().any(|s| s.path.starts_with("/v1/refunds?payment_intent=")));
    let report = audit(&app, &stripe).await;
    assert_eq!(report["clean"], true, "{report:#}");

    // A balance that no longer covers the top-up: 402, nothing refunded.
    let second = app.top_up(&new_key(), "main", AMOUNT, VISA).await;
    let second_id = second.body["id"].as_str().unwrap().to_owned();
    let spent = app.pay(Some(&new_key()), MAIN_BALANCE + 1).await;
    assert_eq!(spent.status, 201, "{}", spent.body);
    app.refund_top_up(&new_key(), &second_id)
        .await
        .assert_problem(402, "insufficient_funds");
    let second_intent = second.body["processor_payment_id"].as_str().unwrap();
    assert!(stripe.refunds_of(second_intent).await.is_empty());
    app.refund_top_up(&new_key(), &uuid::Uuid::new_v4().to_string())
        .await
        .assert_problem(404, "not_found");
}

#[tokio::test]
async fn a_retry_while_the_top_up_is_driven_waits_then_answers_409() {
    let Rig { stripe, proxy, app } = rig(
        first(Call::Confirm, 1, Action::HoldRequest(Duration::from_millis(1_500))),
        |s| {
            s.inflight_wait = Duration::from_millis(300);
            if let Some(p) = s.processor.as_mut() {
                p.timeout = Duration::from_secs(5);
            }
        },
    )
    .await;
    let key = new_key();
    let original = {
        let app = app.clone();
        let key = key.clone();
        tokio::spawn(async move { app.top_up(&key, "main", AMOUNT, VISA).await })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !proxy.arrived().iter().any(|(_, path)| path.ends_with("/confirm")) {
        assert!(Instant::now() < deadline, "the confirmation never left");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = Instant::now();
    let duplicate = app.top_up(&key, "main", AMOUNT, VISA).await;
    duplicate.assert_problem(409, "request_in_progress");
    assert!(duplicate.header("retry-after").is_some());
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "it waited ONCEPAY_INFLIGHT_WAIT_MS"
    );
    let original = original.await.unwrap();
    assert_eq!(original.status, 201, "{}", original.body);
    let replay = app.top_up(&key, "main", AMOUNT, VISA).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, original.body);
    assert_exactly_once(&app, &stripe, original.body["id"].as_str().unwrap(), true).await;
}

#[tokio::test]
async fn a_top_up_whose_client_gave_up_is_finished_by_the_completer() {
    let Rig {
        stripe,
        app,
        proxy: _proxy,
    } = rig(first(Call::Confirm, 1, Action::DropAnswer), |s| {
        s.completer_after = Duration::from_secs(1);
    })
    .await;
    let key = new_key();
    app.top_up(&key, "main", AMOUNT, VISA)
        .await
        .assert_problem(503, "temporarily_unavailable");
    // The client is gone; the completer finishes it.
    let (id, _) = app.top_up_of_key(&key).await.unwrap();
    wait_for_status(&app, &key, "succeeded").await;
    let answer = app.top_up(&key, "main", AMOUNT, VISA).await;
    assert_eq!(answer.status, 201);
    assert!(answer.replayed(), "finished by the completer before this retry");
    assert_exactly_once(&app, &stripe, &id, true).await;
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("oncepay_completer_operations_total{result=\"finished\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("oncepay_processor_calls_total{call=\"retrieve_intent\",outcome=\"ok\"}"));
}

/// A plan that drops the answer of the first `lost` call and answers 404 to every GET of a
/// path that starts with `missing`: the outcome stays unknown however often it is looked at.
fn lost_then_missing(lost: Call, missing: &'static str) -> impl Fn(&Incoming) -> Action + Send + Sync + 'static {
    let drop = first(lost, 1, Action::DropAnswer);
    move |incoming: &Incoming| {
        let path = incoming.path.split('?').next().unwrap_or_default();
        if incoming.method == "GET" && path.starts_with(missing) {
            Action::StripeError {
                status: 404,
                kind: "invalid_request_error",
                code: "resource_missing",
            }
        } else {
            drop(incoming)
        }
    }
}

/// A rig whose `lost` call's answer is dropped and whose GETs under `missing` answer 404,
/// with the completer on (a second after a top-up was left). Kept whole: a dropped
/// `Localstripe` stops its process.
async fn completer_rig(lost: Call, missing: &'static str) -> Rig {
    rig(lost_then_missing(lost, missing), |s| {
        s.completer_after = Duration::from_secs(1)
    })
    .await
}

/// Waits (at most 30 s) for the completer's second look at the top-up `id`, and answers the
/// wait it then set before its third, in seconds.
async fn second_look_put_off(app: &TestApp, proxy: &FaultProxy, id: &str) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (checks, gap): (i32, Option<f64>) = sqlx::query_as(
            "SELECT checks, extract(epoch FROM next_check_at - updated_at)::float8 FROM top_ups
              WHERE tenant_id = $1 AND top_up_id = $2::uuid",
        )
        .bind(app.tenant_id)
        .bind(id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
        if checks >= 2 {
            assert_eq!(checks, 2);
            return gap.expect("the next look is scheduled");
        }
        assert!(
            Instant::now() < deadline,
            "the completer never put its next look off (checks {checks}, {} calls)",
            proxy.seen().len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A PaymentIntent the processor answers 404 for (an emulator restarted empty; a processor
/// that stays down is the same): the top-up stays processing, nothing is credited, and the
/// completer looks again at a growing interval, not in every round.
#[tokio::test]
async fn a_top_up_whose_outcome_stays_unknown_is_looked_at_less_and_less_often() {
    let rig = completer_rig(Call::Confirm, "/v1/payment_intents/").await;
    let (app, proxy) = (&rig.app, &rig.proxy);
    let key = new_key();
    app.top_up(&key, "main", AMOUNT, VISA)
        .await
        .assert_problem(503, "temporarily_unavailable");
    let (id, _) = app.top_up_of_key(&key).await.unwrap();
    let gap = second_look_put_off(app, proxy, &id).await;
    assert!((1.5..=2.5).contains(&gap), "the second wait is doubled: {gap} s");
    let shown = app.get(&format!("/top-ups/{id}")).await.body;
    assert_eq!(shown["status"], "processing", "{shown}");
    assert_eq!(app.balance("main").await, MAIN_BALANCE, "nothing credited");
    // Its key says so: no status yet (it said 201, and the retry then answered 402: found
    // from outside).
    let looked_up = app.get(&format!("/idempotency-keys/{key}")).await.body;
    assert_eq!(
        (&looked_up["status"], &looked_up["code"], &looked_up["resource"]["id"]),
        (&json!(null), &json!(null), &json!(id)),
        "{looked_up}"
    );
    // A client's retry still looks at once (the proxy notes a call after it answered it;
    // every call left to make is a look).
    let before = proxy.seen().len();
    app.top_up(&key, "main", AMOUNT, VISA)
        .await
        .assert_problem(503, "temporarily_unavailable");
    let noted = Instant::now() + Duration::from_secs(5);
    while proxy.seen().len() == before && Instant::now() < noted {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(proxy.seen().len() > before, "the retry looked at the PaymentIntent");
}

/// The same for a refund whose answer was lost and whose refunds the processor cannot list.
#[tokio::test]
async fn a_refund_whose_outcome_stays_unknown_is_looked_at_less_and_less_often() {
    let rig = completer_rig(Call::Refund, "/v1/refunds").await;
    let (app, proxy) = (&rig.app, &rig.proxy);
    let created_key = new_key();
    let created = app.top_up(&created_key, "main", AMOUNT, VISA).await;
    assert_eq!(created.status, 201, "{}", created.body);
    let id = created.body["id"].as_str().unwrap().to_owned();
    let refund_key = new_key();
    app.refund_top_up(&refund_key, &id)
        .await
        .assert_problem(503, "temporarily_unavailable");
    let gap = second_look_put_off(app, proxy, &id).await;
    assert!((1.5..=2.5).contains(&gap), "the second wait is doubled: {gap} s");
    let shown = app.get(&format!("/top-ups/{id}")).await.body;
    assert_eq!(shown["status"], "refund_pending", "{shown}");
    let looked_up = app.get(&format!("/idempotency-keys/{refund_key}")).await.body;
    assert_eq!(
        looked_up["status"],
        json!(null),
        "the refund has not ended: {looked_up}"
    );
    let creation = app.get(&format!("/idempotency-keys/{created_key}")).await.body;
    assert_eq!(creation["status"], 201, "the top-up itself has ended: {creation}");
    assert_eq!(app.balance("main").await, MAIN_BALANCE, "debited once, while pending");
}

pub(crate) async fn wait_for_status(app: &TestApp, key: &str, status: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some((_, now)) = app.top_up_of_key(key).await {
            if now == status {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the top-up under {key} never became {status}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An oncepay server as a process of its own (the binary under test), so that it can be
/// killed with SIGKILL; its completer is off (it dies anyway).
pub(crate) struct ServerProcess {
    child: Child,
    url: String,
}

impl ServerProcess {
    pub(crate) async fn start(processor_url: &str) -> Self {
        Self::start_named(processor_url, &processor_name(processor_url)).await
    }

    /// A server of the processor at `processor_url` named `name` (`ONCEPAY_PROCESSOR_NAME`).
    pub(crate) async fn start_named(processor_url: &str, name: &str) -> Self {
        use tokio::io::AsyncBufReadExt;
        // Port 0: the kernel picks a free port, the process logs it (no race with another
        // test for a port chosen here).
        let mut child = Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .arg("serve")
            .env("DATABASE_URL", server_url(&database_url()))
            .env("ONCEPAY_BIND", "127.0.0.1:0")
            .env("ONCEPAY_METRICS_BIND", "127.0.0.1:0")
            .env("ONCEPAY_PROCESSOR_URL", processor_url)
            .env("ONCEPAY_PROCESSOR_API_KEY", API_KEY)
            .env("ONCEPAY_PROCESSOR_NAME", name)
            .env("ONCEPAY_PROCESSOR_TIMEOUT_MS", TIMEOUT.as_millis().to_string())
            .env("ONCEPAY_COMPLETER_AFTER_SECS", "3600")
            .env("ONCEPAY_DB_POOL_SIZE", "4")
            .env("ONCEPAY_WORKERS", "1")
            .env("ONCEPAY_LOG_FORMAT", "json")
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let port = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                let Ok(log) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                if log["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("oncepay listening"))
                {
                    return log["port"].as_u64().unwrap();
                }
            }
            panic!("the oncepay process exited before listening");
        })
        .await
        .expect("the oncepay process serves within 30 s");
        // Keep reading its log, so that it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let port = u16::try_from(port).unwrap();
        crate::commands::wait_until_ready(&reqwest::Client::new(), port).await;
        Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }

    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// SIGKILL: no shutdown, no lease given back.
    pub(crate) async fn kill_9(mut self) {
        self.child.kill().await.unwrap();
    }
}

/// A top-up sent to a process that is killed with SIGKILL while `call` is out (held by the
/// proxy per `action`); another replica's completer finishes it, and the client's retry
/// with the same key (to that replica) answers the final result.
async fn crash_scenario(call: Call, action: Action, refund: bool) {
    let Rig { stripe, proxy, app } = rig(first(call, 1, action.clone()), |s| {
        s.completer_after = Duration::from_secs(1);
    })
    .await;
    let doomed = ServerProcess::start(&proxy.url).await;
    let client = reqwest::Client::new();
    let send = |url: String, key: String, body: Value| {
        let client = client.clone();
        let api_key = app.api_key.clone();
        tokio::spawn(async move {
            client
                .post(url)
                .bearer_auth(api_key)
                .header("Idempotency-Key", key)
                .json(&body)
                .send()
                .await
        })
    };
    let key = new_key();
    let mut top_up_id = None;
    if refund {
        // The top-up itself goes through the surviving replica.
        let created = app.top_up(&new_key(), "main", AMOUNT, VISA).await;
        assert_eq!(created.status, 201);
        let id = created.body["id"].as_str().unwrap().to_owned();
        send(format!("{}/top-ups/{id}/refund", doomed.url), key.clone(), json!({}));
        top_up_id = Some(id);
    } else {
        send(
            format!("{}/accounts/main/top-ups", doomed.url),
            key.clone(),
            json!({ "amount": AMOUNT, "payment_method": VISA }),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while !proxy.arrived().iter().any(|(method, path)| {
        call.matches(&Incoming {
            index: 0,
            elapsed: Duration::ZERO,
            method: method.clone(),
            path: path.clone(),
        })
    }) {
        assert!(Instant::now() < deadline, "the {call:?} call never left");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if matches!(action, Action::DelayAnswer(_)) {
        // Forwarded: let the processor act on it before the kill.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    doomed.kill_9().await;

    if refund {
        let id = top_up_id.unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let state = app.get(&format!("/top-ups/{id}")).await;
            if state.body["status"] == "refunded" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the refund was never finished: {}",
                state.body
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let answers = retry_until_final(async || app.refund_top_up(&key, &id).await).await;
        let last = answers.last().unwrap();
        assert_eq!(last.status, 200, "{}", last.body);
        let intent = app.get(&format!("/top-ups/{id}")).await.body["processor_payment_id"]
            .as_str()
            .unwrap()
            .to_owned();
        assert_eq!(
            stripe.refunds_of(&intent).await.len(),
            1,
            "refunded once at the processor"
        );
        assert_eq!(app.balance("main").await, MAIN_BALANCE, "credited once, debited once");
        let report = audit(&app, &stripe).await;
        assert_eq!(report["clean"], true, "{report:#}");
        return;
    }
    wait_for_status(&app, &key, "succeeded").await;
    let answers = retry_until_final(async || app.top_up(&key, "main", AMOUNT, VISA).await).await;
    let last = answers.last().unwrap();
    assert_eq!(last.status, 201, "{}", last.body);
    let id = last.body["id"].as_str().unwrap().to_owned();
    assert_exactly_once(&app, &stripe, &id, true).await;
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("oncepay_completer_operations_total{result=\"finished\"} 1"),
        "the other replica's completer finished it: {metrics}"
    );
}

#[tokio::test]
async fn killed_before_the_creation_reached_the_processor() {
    crash_scenario(Call::Create, Action::Swallow, false).await;
}

#[tokio::test]
async fn killed_after_the_payment_intent_was_created_before_its_id_was_committed() {
    crash_scenario(Call::Create, Action::DelayAnswer(Duration::from_secs(25)), false).await;
}

#[tokio::test]
async fn killed_before_the_confirmation_reached_the_processor() {
    crash_scenario(Call::Confirm, Action::Swallow, false).await;
}

#[tokio::test]
async fn killed_after_the_processor_charged_before_the_credit() {
    crash_scenario(Call::Confirm, Action::DelayAnswer(Duration::from_secs(25)), false).await;
}

#[tokio::test]
async fn killed_after_the_debit_while_the_refund_was_at_the_processor() {
    crash_scenario(Call::Refund, Action::DelayAnswer(Duration::from_secs(25)), true).await;
}

#[tokio::test]
async fn the_audit_names_a_charge_without_a_credited_top_up() {
    let Rig {
        stripe,
        app,
        proxy: _proxy,
    } = rig(|_: &Incoming| Action::Forward, |_| {}).await;
    let created = app.top_up(&new_key(), "main", AMOUNT, VISA).await;
    let id = created.body["id"].as_str().unwrap().to_owned();
    assert_eq!(audit(&app, &stripe).await["clean"], true);
    // A second charge naming the same top-up, made behind oncepay's back.
    let intent = stripe.charge_behind_the_back(&id, AMOUNT).await;
    let report = audit(&app, &stripe).await;
    assert_eq!(report["clean"], false, "{report:#}");
    let samples = report["invariants"]["top_ups"]["samples"].as_array().unwrap();
    assert!(
        samples.iter().any(|s| s["processor_payment_id"] == intent.as_str()),
        "the finding names the PaymentIntent: {report:#}"
    );
    let output = Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .args(["audit", "--tenant", &app.tenant_id.to_string()])
        .env("DATABASE_URL", database_url())
        .env("ONCEPAY_PROCESSOR_URL", &stripe.url)
        .env("ONCEPAY_PROCESSOR_API_KEY", API_KEY)
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(oncepay::audit::EXIT_BROKEN));
    assert!(String::from_utf8_lossy(&output.stdout).contains(&intent));
}

/// With every processor call held 500 ms and a pool of two connections, balance payments run
/// beside a stream of top-ups without waiting for a connection: no top-up holds one while
/// its call is out.
#[tokio::test]
async fn a_slow_processor_does_not_slow_balance_payments() {
    let Rig {
        stripe,
        app,
        proxy: _proxy,
    } = rig(
        |_: &Incoming| Action::HoldRequest(Duration::from_millis(500)),
        |s| {
            s.db_pool_size = 2;
            if let Some(p) = s.processor.as_mut() {
                p.timeout = Duration::from_secs(5);
            }
        },
    )
    .await;
    let top_ups: Vec<_> = (0..6)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { app.top_up(&new_key(), "main", AMOUNT, VISA).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut slowest = Duration::ZERO;
    let started = Instant::now();
    let mut paid = 0;
    while started.elapsed() < Duration::from_millis(1_500) {
        let t = Instant::now();
        let answer = app.pay(Some(&new_key()), 1).await;
        assert_eq!(answer.status, 201, "{}", answer.body);
        slowest = slowest.max(t.elapsed());
        paid += 1;
    }
    for top_up in top_ups {
        let answer = top_up.await.unwrap();
        assert_eq!(answer.status, 201, "{}", answer.body);
    }
    println!("{paid} payments beside 6 top-ups held 500 ms a call, the slowest took {slowest:?}");
    assert!(paid >= 10, "only {paid} payments in 1.5 s");
    assert!(
        slowest < Duration::from_millis(450),
        "a payment waited {slowest:?}: a top-up held a connection across a processor call"
    );
    assert_eq!(
        stripe
            .intents()
            .await
            .iter()
            .filter(|i| i["status"] == "succeeded")
            .count(),
        6
    );
}

/// `oncepay top-up` (the retrying client of the CLI) through a lost confirmation: it retries
/// with its key and prints the top-up; `get-top-up` and `refund-top-up` follow.
#[tokio::test]
async fn the_cli_tops_up_across_a_lost_answer() {
    let Rig {
        stripe,
        app,
        proxy: _proxy,
    } = rig(first(Call::Confirm, 1, Action::DropAnswer), |_| {}).await;
    let env = [
        ("ONCEPAY_URL", app.address.as_str()),
        ("ONCEPAY_API_KEY", app.api_key.as_str()),
    ];
    let key = new_key();
    let run = crate::cli::oncepay(
        &["top-up", "--amount", "5000", "--payment-method", VISA, "--key", &key],
        &env,
    )
    .await;
    assert_eq!(run.status, 0, "{}", run.stderr);
    let top_up = run.json();
    assert_eq!(top_up["status"], "succeeded");
    assert!(run.stderr.contains("503"), "the retry shows on stderr: {}", run.stderr);
    let id = top_up["id"].as_str().unwrap().to_owned();
    let state = crate::cli::oncepay(&["get-top-up", &id], &env).await;
    assert_eq!(state.json()["status"], "succeeded");
    assert_exactly_once(&app, &stripe, &id, true).await;
    let refund = crate::cli::oncepay(&["refund-top-up", "--top-up", &id], &env).await;
    assert_eq!(refund.status, 0, "{}", refund.stderr);
    assert_eq!(refund.json()["status"], "refunded");
    let declined = crate::cli::oncepay(&["top-up", "--amount", "5000", "--payment-method", DECLINED], &env).await;
    assert_eq!(declined.status, 3, "{}", declined.stderr);
    assert!(declined.stderr.contains("card_declined"), "{}", declined.stderr);
    assert!(
        declined.stderr.contains("decline_code=card_declined"),
        "the processor's reason the detail points to: {}",
        declined.stderr
    );
}

/// Top-up events (docs/webhooks.md, the events): each final state of a top-up is one
/// event, written in the transaction of its change and delivered signed, in order per top-up
/// (`top_up.succeeded` before `top_up.refunded`); a decline is `top_up.failed`; a replay, a
/// reused key and an unknown account write none. The data is the top-up as its `GET` shows it.
#[tokio::test]
async fn each_final_state_of_a_top_up_is_one_event_delivered_in_order() {
    let Rig {
        stripe: _stripe,
        proxy: _proxy,
        app,
    } = rig(|_: &Incoming| Action::Forward, |s| s.webhooks.concurrency = 4).await;
    let receiver = crate::support::webhook_receiver::Receiver::start().await;
    let endpoint = app
        .post(
            "/webhook-endpoints",
            Some(&new_key()),
            &json!({ "url": receiver.url() }),
        )
        .await;
    assert_eq!(endpoint.status, 201, "{}", endpoint.body);
    receiver.set_secret(endpoint.body["secret"].as_str().unwrap());

    let key = new_key();
    let charged = app.top_up(&key, "main", AMOUNT, VISA).await;
    assert_eq!(charged.status, 201, "{}", charged.body);
    let charged_id = charged.body["id"].as_str().unwrap().to_owned();
    assert!(app.top_up(&key, "main", AMOUNT, VISA).await.replayed());
    app.top_up(&key, "main", AMOUNT + 1, VISA)
        .await
        .assert_problem(422, "idempotency_key_reused");
    app.top_up(&new_key(), "nobody", AMOUNT, VISA)
        .await
        .assert_problem(404, "account_not_found");
    let declined_key = new_key();
    app.top_up(&declined_key, "main", AMOUNT, DECLINED)
        .await
        .assert_problem(402, "card_declined");
    let (declined_id, _) = app.top_up_of_key(&declined_key).await.unwrap();
    let refunded = app.refund_top_up(&new_key(), &charged_id).await;
    assert_eq!(refunded.status, 200, "{}", refunded.body);

    let expected = std::collections::BTreeMap::from([
        (charged_id.clone(), vec!["top_up.succeeded", "top_up.refunded"]),
        (declined_id.clone(), vec!["top_up.failed"]),
    ]);
    receiver.wait_for_acknowledged(3, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = receiver.check(&expected);
    assert_eq!(report.events, 3, "{report:?}");

    let data_of = |event_type: &str, resource: &str| {
        let messages = receiver.messages();
        let message = messages
            .iter()
            .find(|m| m.event_type == event_type && m.resource == resource)
            .unwrap_or_else(|| panic!("{event_type} of {resource}"));
        message.body["data"].clone()
    };
    let succeeded = data_of("top_up.succeeded", &charged_id);
    assert_eq!(succeeded["status"], "succeeded");
    assert_eq!(succeeded["amount"], AMOUNT);
    assert_eq!(succeeded["currency"], "usd");
    assert_eq!(succeeded["account"], "main");
    assert_eq!(succeeded["processor_payment_id"], charged.body["processor_payment_id"]);
    assert_eq!(data_of("top_up.refunded", &charged_id)["status"], "refunded");
    let failed = data_of("top_up.failed", &declined_id);
    assert_eq!(failed["status"], "failed");
    assert_eq!(failed["failure_code"], "card_declined");
    // The same fields as the top-up's GET, and nothing else.
    let shown = app.get(&format!("/top-ups/{declined_id}")).await;
    let mut fields_shown: Vec<_> = shown.body.as_object().unwrap().keys().cloned().collect();
    let mut fields_sent: Vec<_> = failed.as_object().unwrap().keys().cloned().collect();
    fields_shown.sort();
    fields_sent.sort();
    assert_eq!(fields_sent, fields_shown);
}

/// Found from outside (replicas stopped under traffic): at a graceful stop, a top-up whose call
/// to the processor was out got 503 "outcome unknown" for a call the processor ran ("dispatch
/// task is gone: runtime dropped the dispatch task"). Each HTTP worker is a runtime of its
/// own; the processor client's pooled connection had been opened by another worker, whose
/// runtime ended at once, being idle. Top-ups are now driven on the main runtime, with
/// database connections of their own: the top-up held at the processor across the signal gets
/// its real answer.
#[tokio::test]
async fn a_graceful_stop_lets_a_top_up_whose_processor_call_is_out_get_its_answer() {
    use crate::commands::{free_port, serve_logged, sigterm, stop_logged, wait_until_ready};
    use crate::support::tcp_relay::TcpRelay;
    let stripe = Localstripe::start().await;
    let relay = TcpRelay::start(stripe.url.trim_start_matches("http://").to_owned()).await;
    let processor = format!("http://127.0.0.1:{}", relay.port);
    let app = crate::support::helpers::spawn_app().await;
    let port = free_port();
    let (mut server, logs) = serve_logged(&[
        ("DATABASE_URL", server_url(&database_url())),
        ("ONCEPAY_BIND", format!("127.0.0.1:{port}")),
        ("ONCEPAY_METRICS_BIND", "127.0.0.1:0".to_owned()),
        ("ONCEPAY_WORKERS", "2".to_owned()),
        ("ONCEPAY_WEBHOOK_CONCURRENCY", "0".to_owned()),
        ("ONCEPAY_PROCESSOR_URL", processor.clone()),
        ("ONCEPAY_PROCESSOR_API_KEY", API_KEY.to_owned()),
        ("ONCEPAY_PROCESSOR_NAME", processor_name(&processor)),
        ("ONCEPAY_PROCESSOR_TIMEOUT_MS", "10000".to_owned()),
        ("ONCEPAY_COMPLETER_AFTER_SECS", "3600".to_owned()),
    ]);
    wait_until_ready(&reqwest::Client::new(), port).await;
    let top_up = |client: reqwest::Client, key: String| {
        let api_key = app.api_key.clone();
        async move {
            client
                .post(format!("http://127.0.0.1:{port}/accounts/main/top-ups"))
                .bearer_auth(api_key)
                .header("Idempotency-Key", key)
                .json(&json!({ "amount": AMOUNT, "payment_method": VISA }))
                .send()
                .await
        }
    };
    // One connection, one worker: its top-up leaves the processor connection it opened in
    // the server's pool; the connection to the server then closes, and that worker has
    // nothing more to do.
    let first = reqwest::Client::new();
    let done = top_up(first.clone(), new_key()).await.unwrap();
    assert_eq!(done.status(), 201, "{}", done.text().await.unwrap());
    drop(first);
    // Another connection, the other worker; its calls to the processor held at the relay.
    relay.silence();
    let key = new_key();
    let held = tokio::spawn(top_up(reqwest::Client::new(), key.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    sigterm(&server);
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    relay.resume();
    let answer = held.await.unwrap();
    let stopped = tokio::time::timeout(Duration::from_secs(20), server.wait()).await;
    let logs = if stopped.is_ok() {
        logs.await.unwrap()
    } else {
        stop_logged(&mut server, logs).await
    };
    let (status, body) = match answer {
        Ok(answer) => (answer.status().as_u16(), answer.text().await.unwrap_or_default()),
        Err(err) => (0, err.to_string()),
    };
    assert_eq!(status, 201, "the top-up held across the signal: {body}\n{logs}");
    assert!(!logs.contains("dispatch task is gone"), "{logs}");
    let (id, _) = app.top_up_of_key(&key).await.expect("the top-up's row");
    assert_eq!(stripe.succeeded_of(&id).await, 1, "charged once");
    assert_eq!(
        app.balance("main").await,
        MAIN_BALANCE + 2 * AMOUNT,
        "both credited once"
    );
}
