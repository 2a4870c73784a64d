//! Card top-ups against Stripe's rules that localstripe lacks (docs/top-ups.md),
//! applied by the fault proxy (`crate::stripe_rules`): a pinned `Stripe-Version`, 5xx answers
//! saved under their key, automatic payment methods and their `return_url`, minimum amounts,
//! refusals by code, PaymentIntents that wait (`requires_action`, `processing`), refunds that
//! are `pending` and then fail, leases that hold, and a processor named by its name. Each
//! scenario also checks the promises of `top_ups.rs`: at most one succeeded PaymentIntent, the
//! balance credited exactly once iff one did, the audit clean.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::stripe_rules::StripeRules;
use crate::support::fault_proxy::{Action, Incoming};
use crate::support::helpers::{new_key, TestApp, MAIN_BALANCE};
use crate::top_ups::{
    assert_exactly_once, audit, first, retry_until_final, rig, rig_with, wait_for_status, Call, Rig, ServerProcess,
    AMOUNT, VISA,
};

/// Stripe's test card that needs 3-D Secure on every payment (localstripe holds it too).
const AUTHENTICATION_REQUIRED: &str = "4000002760003184";

/// The `Stripe-Version` docs/top-ups.md names.
const PINNED_VERSION: &str = "2024-06-20";

/// Polls `GET /top-ups/{id}` until `done` holds (30 s at most); gives the last state.
async fn wait_for_state(app: &TestApp, id: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = app.get(&format!("/top-ups/{id}")).await;
        assert_eq!(state.status, 200, "{}", state.body);
        if done(&state.body) {
            return state.body;
        }
        assert!(Instant::now() < deadline, "the top-up never got there: {}", state.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn every_call_pins_the_stripe_version_named_in_the_docs() {
    let Rig { stripe, proxy, app } = rig(|_: &Incoming| Action::Forward, |_| {}).await;
    let created = app.top_up(&new_key(), "main", AMOUNT, VISA).await;
    assert_eq!(created.status, 201, "{}", created.body);
    let id = created.body["id"].as_str().unwrap();
    let refunded = app.refund_top_up(&new_key(), id).await;
    assert_eq!(refunded.status, 200, "{}", refunded.body);
    let seen = proxy.seen();
    assert!(seen.len() >= 3, "create, confirm, refund: {seen:?}");
    for call in &seen {
        assert_eq!(
            call.stripe_version.as_deref(),
            Some(PINNED_VERSION),
            "{} {call:?}",
            call.path
        );
    }
    assert!(
        include_str!("../../docs/top-ups.md").contains(&format!("`Stripe-Version: {PINNED_VERSION}`")),
        "docs/top-ups.md names the pinned version"
    );
    let report = audit(&app, &stripe).await;
    assert_eq!(report["clean"], true, "{report:#}");
}

/// A top-up whose create or confirm meets a 5xx that Stripe saves under its key: every retry
/// with that key gets it again (`Idempotent-Replayed: true`), so the client's retries end on
/// 201 only if oncepay reads the processor's state instead of waiting on the key.
async fn saved_5xx_scenario(call: Call, action: Action, met_again: bool) -> (Rig, String) {
    let rig = rig(first(call, 1, action.clone()), |_| {}).await;
    let key = new_key();
    let answers = retry_until_final(async || rig.app.top_up(&key, "main", AMOUNT, VISA).await).await;
    answers[0].assert_problem(503, "temporarily_unavailable");
    let last = answers.last().unwrap();
    assert_eq!(last.status, 201, "{action:?} on {call:?}: {}", last.body);
    assert!(!last.replayed());
    let id = last.body["id"].as_str().unwrap().to_owned();
    assert_eq!(
        answers[0].header("location"),
        Some(format!("/top-ups/{id}").as_str()),
        "the 503 of an unknown outcome names its top-up"
    );
    let seen = rig.proxy.seen();
    assert_eq!(
        seen.iter().any(|s| s.action == Action::Stripe("saved_5xx_replayed")),
        met_again,
        "a retry met the saved answer: {seen:?}"
    );
    assert_exactly_once(&rig.app, &rig.stripe, &id, true).await;
    (rig, id)
}

/// Found from outside: a keyless top-up (policy `allow`) whose confirmation's answer was lost
/// was told to "retry with the same Idempotency-Key", which it has not got; sending it again
/// made a second top-up and charged the card twice. Its 503 now says that a retry may do it
/// twice and to look first, with no Retry-After.
#[tokio::test]
async fn a_keyless_top_up_whose_outcome_is_unknown_is_not_invited_to_send_it_again() {
    let rig = rig(first(Call::Confirm, 1, Action::DropAnswer), |_| {}).await;
    let (tenant, api_key) =
        crate::support::helpers::new_tenant(&rig.app.pool, oncepay::domain::MissingKeyPolicy::Allow).await;
    let keyless = async || keyless_top_up(&rig.app, &api_key, VISA).await;
    let answer = keyless().await;
    answer.assert_problem(503, "temporarily_unavailable");
    assert_eq!(answer.body["title"], "Outcome unknown", "{}", answer.body);
    let detail = answer.body["detail"].as_str().unwrap();
    assert!(
        detail.contains("no Idempotency-Key") && detail.contains("twice"),
        "{detail}"
    );
    assert_eq!(answer.header("retry-after"), None, "a retry is not invited");
    // The top-up is named, to look at rather than send again (found from outside: the client
    // was told to search `GET /top-ups` newest first).
    let location = answer.header("location").expect("the top-up named").to_owned();
    assert!(detail.contains(&location), "{detail}");
    let shown = rig.app.get_as(&api_key, &location).await;
    assert_eq!(shown.status, 200, "{}", shown.body);

    // Sent again all the same (as the probe's client did): a second top-up, a second charge,
    // which the audit lists among its warnings.
    let again = keyless().await;
    assert_eq!(again.status, 201, "{}", again.body);
    let report = crate::top_ups::audit_of(tenant, &rig.stripe).await;
    let duplicates = &report["warnings"]["suspected_keyless_top_up_duplicates"];
    assert_eq!(duplicates["count"], 1, "{report:#}");
    assert_eq!(duplicates["samples"][0]["amount"], AMOUNT, "{report:#}");
    assert_eq!(report["clean"], true, "a suspicion, not a broken invariant: {report:#}");
}

/// Found from outside (a rollout: replicas of an older build told a keyless `fingerprint` top-up
/// waiting for 3-D Secure to "retry with the same Idempotency-Key"): sent again after its
/// derived key's 60 s it was a second top-up, and the audit, which looked for keyless pairs
/// within 5 s, said nothing. A pair whose later top-up was made while the earlier was still
/// unfinished is suspected whatever the time between them.
#[tokio::test]
async fn the_audit_suspects_a_keyless_top_up_made_while_an_identical_one_was_unfinished() {
    let rig = rig(|_: &Incoming| Action::Forward, |_| {}).await;
    let (tenant, api_key) =
        crate::support::helpers::new_tenant(&rig.app.pool, oncepay::domain::MissingKeyPolicy::Fingerprint).await;
    let card = rig.stripe.card(AUTHENTICATION_REQUIRED).await;
    keyless_top_up(&rig.app, &api_key, &card)
        .await
        .assert_problem(503, "temporarily_unavailable");
    // 65 s ago: past the derived key's window and the audit's 5 s.
    for table in ["top_ups", "idempotency_keys"] {
        sqlx::query(&format!(
            "UPDATE {table} SET created_at = created_at - interval '65 seconds' WHERE tenant_id = $1"
        ))
        .bind(tenant)
        .execute(&rig.app.pool)
        .await
        .unwrap();
    }
    sqlx::query("UPDATE idempotency_keys SET expires_at = expires_at - interval '65 seconds' WHERE tenant_id = $1")
        .bind(tenant)
        .execute(&rig.app.pool)
        .await
        .unwrap();
    keyless_top_up(&rig.app, &api_key, &card)
        .await
        .assert_problem(503, "temporarily_unavailable");
    let made: i64 = sqlx::query_scalar("SELECT count(*) FROM top_ups WHERE tenant_id = $1")
        .bind(tenant)
        .fetch_one(&rig.app.pool)
        .await
        .unwrap();
    assert_eq!(made, 2, "a second top-up, as the probe's");
    let report = crate::top_ups::audit_of(tenant, &rig.stripe).await;
    let duplicates = &report["warnings"]["suspected_keyless_top_up_duplicates"];
    assert_eq!(duplicates["count"], 1, "{report:#}");
    assert!(
        duplicates["samples"][0]["seconds_apart"].as_f64().unwrap() >= 65.0,
        "{report:#}"
    );
}

/// The key series `column` of top-up `id` (`confirm_key_series`, `refund_key_series`, ...):
/// how many keys of that call a saved 5xx has spent.
async fn key_series(app: &TestApp, id: &str, column: &str) -> i32 {
    sqlx::query_scalar(&format!(
        "SELECT {column} FROM top_ups WHERE tenant_id = $1 AND top_up_id = $2::uuid"
    ))
    .bind(app.tenant_id)
    .bind(id)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// A top-up sent without an `Idempotency-Key` with the tenant's `api_key`.
async fn keyless_top_up(app: &TestApp, api_key: &str, card: &str) -> crate::support::helpers::Answer {
    let sent = app
        .client
        .post(format!("{}/accounts/main/top-ups", app.address))
        .bearer_auth(api_key)
        .json(&json!({ "amount": AMOUNT, "payment_method": card }))
        .send()
        .await
        .unwrap();
    crate::support::helpers::Answer::from(sent).await
}

/// Found from outside: a keyless top-up waiting for the cardholder's 3-D Secure was answered
/// "outcome unknown, look first" with nothing to look at: its 503 now names the top-up in
/// `Location` and tells the client not to send it again (the completer ends it).
///
/// The same under policy `fingerprint` (found from outside: the request, keyless, had a key
/// the server derived from its body for 60 s, and was told "Retry-After: 5, retry with the
/// same Idempotency-Key"; resent after the 60 s it was a second top-up and a second charge).
#[tokio::test]
async fn a_keyless_top_up_that_waits_at_the_processor_names_the_top_up_to_look_at() {
    let rig = rig(|_: &Incoming| Action::Forward, |_| {}).await;
    for policy in [
        oncepay::domain::MissingKeyPolicy::Allow,
        oncepay::domain::MissingKeyPolicy::Fingerprint,
    ] {
        keyless_top_up_waits(&rig, policy).await;
    }
}

async fn keyless_top_up_waits(rig: &crate::top_ups::Rig, policy: oncepay::domain::MissingKeyPolicy) {
    let (_, api_key) = crate::support::helpers::new_tenant(&rig.app.pool, policy).await;
    let card = rig.stripe.card(AUTHENTICATION_REQUIRED).await;
    let answer = keyless_top_up(&rig.app, &api_key, &card).await;
    answer.assert_problem(503, "temporarily_unavailable");
    assert_eq!(
        answer.body["title"], "Top-up waiting at the processor",
        "{}",
        answer.body
    );
    assert_eq!(answer.header("retry-after"), None, "a retry is not invited");
    let location = answer.header("location").expect("the top-up named").to_owned();
    let detail = answer.body["detail"].as_str().unwrap();
    assert!(
        detail.contains(&location) && detail.contains("second top-up"),
        "{detail}"
    );
    let shown = rig
        .app
        .client
        .get(format!("{}{location}", rig.app.address))
        .bearer_auth(&api_key)
        .send()
        .await
        .unwrap();
    let shown = crate::support::helpers::Answer::from(shown).await;
    assert_eq!(shown.status, 200, "{}", shown.body);
    assert_eq!(shown.body["processor_status"], "requires_action", "{}", shown.body);
}

/// Found from outside: a refund whose creation met one 500 that Stripe saved under its key
/// (no refund made) stayed `refund_pending` for as long as Stripe keeps the key: each drive
/// looked, found no refund, and stopped as if Stripe had said "already refunded" before it
/// moved on to the next key; the balance stayed debited and the card unrefunded. A saved 5xx
/// moves the series on, as it does for the PaymentIntent's calls.
#[tokio::test]
async fn a_refund_whose_creation_met_one_saved_500_is_made_under_the_next_key() {
    let rig = rig(first(Call::Refund, 1, Action::ServerError), |_| {}).await;
    let created = rig.app.top_up(&new_key(), "main", AMOUNT, VISA).await;
    assert_eq!(created.status, 201, "{}", created.body);
    let id = created.body["id"].as_str().unwrap().to_owned();
    let intent = created.body["processor_payment_id"].as_str().unwrap().to_owned();
    let key = new_key();
    let answers = retry_until_final(async || rig.app.refund_top_up(&key, &id).await).await;
    let last = answers.last().unwrap();
    assert_eq!(last.status, 200, "{answers:?}");
    assert_eq!(last.body["status"], "refunded", "{}", last.body);
    assert_eq!(rig.stripe.refunds_of(&intent).await.len(), 1, "refunded once");
    assert_eq!(rig.app.balance("main").await, MAIN_BALANCE, "debited once");
    let series = key_series(&rig.app, &id, "refund_key_series").await;
    assert_eq!(series, 1, "key 0 met the saved 500; key 1 made the refund");
}

/// Found from outside: a client retrying each second as told spent one key of the confirm
/// series a retry while Stripe saved a 500 under each, and at the 20th the drive stopped for
/// good: every later look met that key's saved 500, for as long as Stripe keeps keys (a day or
/// more) after it answered again. Past the 20th key only the completer moves the series on, at
/// its pace, and the top-up ends.
#[tokio::test]
async fn past_twenty_saved_500s_of_its_confirmation_a_top_up_ends_once_stripe_answers_again() {
    let rig = rig(first(Call::Confirm, 21, Action::ServerError), |s| {
        s.completer_after = Duration::from_secs(1)
    })
    .await;
    let key = new_key();
    for _ in 0..30 {
        if rig.app.top_up(&key, "main", AMOUNT, VISA).await.status != 503 {
            break;
        }
    }
    let (id, _) = rig.app.top_up_of_key(&key).await.unwrap();
    let done = wait_for_state(&rig.app, &id, |s| s["status"] != "processing").await;
    assert_eq!(done["status"], "succeeded", "{done}");
    let series = key_series(&rig.app, &id, "confirm_key_series").await;
    assert_eq!(series, 21, "it met the 21 saved 500s, keys 0 to 20, and went on");
    assert_exactly_once(&rig.app, &rig.stripe, &id, true).await;
}

#[tokio::test]
async fn a_saved_500_after_the_creation_acted_adopts_the_payment_intent_found_by_its_metadata() {
    let (rig, id) = saved_5xx_scenario(Call::Create, Action::ForwardThenStatus(500), true).await;
    // The PaymentIntent the failed call made is the top-up's: no second one was created.
    assert_eq!(rig.stripe.intents_of(&id).await.len(), 1);
    let creates: Vec<_> = rig
        .proxy
        .seen()
        .into_iter()
        .filter(|s| s.path == "/v1/payment_intents")
        .collect();
    assert!(creates
        .iter()
        .all(|s| s.key.as_deref() == Some(&format!("oncepay-top-up-{id}-create-intent") as &str)));
}

#[tokio::test]
async fn a_saved_500_before_the_creation_acted_creates_under_the_next_key() {
    let (rig, id) = saved_5xx_scenario(Call::Create, Action::ServerError, true).await;
    assert_eq!(
        rig.stripe.intents_of(&id).await.len(),
        1,
        "nothing was made under the first key"
    );
    let next = format!("oncepay-top-up-{id}-create-intent-1");
    assert!(
        rig.proxy
            .seen()
            .iter()
            .any(|s| s.key.as_deref() == Some(&next as &str) && s.status == Some(200)),
        "created under {next}"
    );
}

/// The retry looks before it confirms again, so it never meets the saved answer.
#[tokio::test]
async fn a_saved_500_after_the_confirmation_charged_is_resolved_by_a_look() {
    let (rig, id) = saved_5xx_scenario(Call::Confirm, Action::ForwardThenStatus(500), false).await;
    let confirms = rig.proxy.seen().iter().filter(|s| s.path.ends_with("/confirm")).count();
    assert_eq!(confirms, 1, "no confirmation after the look found it succeeded");
    assert_eq!(rig.stripe.intents_of(&id).await.len(), 1);
}

#[tokio::test]
async fn a_saved_500_before_the_confirmation_charged_confirms_under_the_next_key() {
    let (rig, id) = saved_5xx_scenario(Call::Confirm, Action::ServerError, true).await;
    let next = format!("oncepay-top-up-{id}-confirm-1");
    assert!(
        rig.proxy
            .seen()
            .iter()
            .any(|s| s.key.as_deref() == Some(&next as &str) && s.status == Some(200)),
        "confirmed under {next}"
    );
}

#[tokio::test]
async fn a_payment_intent_is_created_for_cards_so_that_its_confirmation_needs_no_return_url() {
    let Rig { stripe, proxy, app } = rig(|_: &Incoming| Action::Forward, |_| {}).await;
    let key = new_key();
    // Bounded: the code before V23 met the return_url refusal and looked again for ever.
    let answers = retry_until_final(async || app.top_up(&key, "main", AMOUNT, VISA).await).await;
    let last = answers.last().unwrap();
    assert_eq!(last.status, 201, "{}", last.body);
    let create = proxy
        .seen()
        .into_iter()
        .find(|s| s.path == "/v1/payment_intents")
        .unwrap();
    let form = String::from_utf8(create.body).unwrap();
    assert!(form.contains("payment_method_types%5B%5D=card"), "{form}");
    assert!(
        !proxy
            .seen()
            .iter()
            .any(|s| s.action == Action::Stripe("return_url_required")),
        "no confirmation was refused for a missing return_url"
    );
    assert_exactly_once(&app, &stripe, last.body["id"].as_str().unwrap(), true).await;
}

#[tokio::test]
async fn an_amount_below_the_processors_minimum_is_a_stored_invalid_request_naming_its_code() {
    let Rig {
        stripe,
        app,
        proxy: _proxy,
    } = rig(|_: &Incoming| Action::Forward, |_| {}).await;
    let key = new_key();
    let refused = app.top_up(&key, "main", 49, VISA).await;
    refused.assert_problem(400, "invalid_request");
    assert_eq!(refused.body["decline_code"], "amount_too_small", "{}", refused.body);
    assert!(!refused.replayed());
    let again = app.top_up(&key, "main", 49, VISA).await;
    again.assert_problem(400, "invalid_request");
    assert!(again.replayed());
    assert_eq!(again.body, refused.body);
    let (id, status) = app.top_up_of_key(&key).await.unwrap();
    assert_eq!(status, "failed");
    let state = app.get(&format!("/top-ups/{id}")).await.body;
    assert_eq!(state["failure_code"], "invalid_request", "{state}");
    assert_eq!(state["decline_code"], "amount_too_small", "{state}");
    assert_eq!(app.balance("main").await, MAIN_BALANCE);
    assert!(stripe.intents_of(&id).await.is_empty());
    assert_eq!(audit(&app, &stripe).await["clean"], true);
}

/// Found from outside: Stripe's 401 (oncepay's own API key revoked or mistyped) was stored
/// as the merchant's 400 `invalid_request`, replayed for good. It is the operator's to mend:
/// the top-up stays unfinished (503, retry with the key) and goes on once the key works.
#[tokio::test]
async fn the_processor_refusing_oncepays_credentials_is_not_stored_as_the_merchants_failure() {
    let unauthorized = Action::StripeError {
        status: 401,
        kind: "invalid_request_error",
        code: "api_key_expired",
    };
    let rig = rig(first(Call::Create, 1, unauthorized), |_| {}).await;
    let key = new_key();
    let first = rig.app.top_up(&key, "main", AMOUNT, VISA).await;
    first.assert_problem(503, "temporarily_unavailable");
    let retried = rig.app.top_up(&key, "main", AMOUNT, VISA).await;
    assert_eq!(retried.status, 201, "{}", retried.body);
    let id = retried.body["id"].as_str().unwrap().to_owned();
    assert_exactly_once(&rig.app, &rig.stripe, &id, true).await;
}

#[tokio::test]
async fn an_unexpected_refusal_is_a_stored_failure_with_the_processors_code_not_an_unknown_outcome() {
    let refusal = Action::StripeError {
        status: 400,
        kind: "invalid_request_error",
        code: "parameter_unknown",
    };
    let Rig {
        stripe,
        app,
        proxy: _proxy,
    } = rig(first(Call::Create, 1, refusal), |_| {}).await;
    let key = new_key();
    let refused = app.top_up(&key, "main", AMOUNT, VISA).await;
    refused.assert_problem(400, "invalid_request");
    assert_eq!(refused.body["decline_code"], "parameter_unknown", "{}", refused.body);
    assert!(app.top_up(&key, "main", AMOUNT, VISA).await.replayed());
    let (id, status) = app.top_up_of_key(&key).await.unwrap();
    assert_eq!(status, "failed");
    assert!(stripe.intents_of(&id).await.is_empty(), "nothing was created");
    assert_eq!(app.balance("main").await, MAIN_BALANCE);
    assert_eq!(audit(&app, &stripe).await["clean"], true);

    // An unknown payment method, as Stripe answers it (localstripe's bare 404 made Stripe's).
    let invalid = app.top_up(&new_key(), "main", AMOUNT, "pm_no_such_method").await;
    invalid.assert_problem(400, "invalid_payment_method");
    assert_eq!(invalid.body["decline_code"], "resource_missing");
}

/// Found from outside: a PaymentIntent waiting for 3-D Secure and canceled by someone else
/// (the Dashboard, another system of the merchant) long before oncepay's action timeout was
/// stored as `authentication_required`, the failure of oncepay's own cancel at that timeout.
#[tokio::test]
async fn a_payment_intent_canceled_by_someone_else_fails_as_canceled_not_as_unauthenticated() {
    let Rig {
        stripe,
        proxy: _proxy,
        app,
    } = rig(
        |_: &Incoming| Action::Forward,
        |s| s.completer_after = Duration::from_secs(1),
    )
    .await;
    let card = stripe.card(AUTHENTICATION_REQUIRED).await;
    let key = new_key();
    app.top_up(&key, "main", AMOUNT, &card)
        .await
        .assert_problem(503, "temporarily_unavailable");
    let (id, _) = app.top_up_of_key(&key).await.unwrap();
    let waiting = app.get(&format!("/top-ups/{id}")).await.body;
    assert_eq!(waiting["processor_status"], "requires_action", "{waiting}");
    let intent = waiting["processor_payment_id"].as_str().unwrap().to_owned();
    assert_eq!(stripe.cancel_behind_the_back(&intent).await["status"], "canceled");

    let answer = app.top_up(&key, "main", AMOUNT, &card).await;
    answer.assert_problem(402, "card_declined");
    assert_eq!(answer.body["decline_code"], "canceled", "{}", answer.body);
    let failed = app.get(&format!("/top-ups/{id}")).await.body;
    assert_eq!(failed["status"], "failed", "{failed}");
    assert_eq!(failed["failure_code"], "canceled", "{failed}");
    assert_eq!(app.balance("main").await, MAIN_BALANCE, "nothing credited");
    assert_eq!(audit(&app, &stripe).await["clean"], true);
}

#[tokio::test]
async fn a_payment_intent_that_requires_an_action_is_canceled_after_the_action_timeout() {
    let Rig { stripe, proxy, app } = rig(
        |_: &Incoming| Action::Forward,
        |s| {
            s.completer_after = Duration::from_secs(1);
            s.topup_action_timeout = Duration::from_secs(3);
        },
    )
    .await;
    let card = stripe.card(AUTHENTICATION_REQUIRED).await;
    let key = new_key();
    let first = app.top_up(&key, "main", AMOUNT, &card).await;
    first.assert_problem(503, "temporarily_unavailable");
    // Not a lost answer: a wait that may last minutes, said as such.
    assert_eq!(first.body["title"], "Top-up waiting at the processor", "{}", first.body);
    assert_eq!(first.header("retry-after"), Some("5"));
    let (id, _) = app.top_up_of_key(&key).await.unwrap();
    assert_eq!(first.header("location"), Some(format!("/top-ups/{id}").as_str()));
    assert!(first.body["detail"]
        .as_str()
        .unwrap()
        .contains(&format!("GET /top-ups/{id}")));
    // Counted as a wait, not as an outage's 503.
    let metrics = app.metrics().await;
    assert_eq!(requests_of(&metrics, "waiting"), 1, "{metrics}");
    assert_eq!(requests_of(&metrics, "transient_error"), 0, "{metrics}");
    assert!(
        !metrics.contains("oncepay_errors_total{code=\"temporarily_unavailable\"}"),
        "not an error answer for OncepayUnavailable to page on: {metrics}"
    );
    let waiting = app.get(&format!("/top-ups/{id}")).await.body;
    assert_eq!(waiting["status"], "processing", "{waiting}");
    assert_eq!(waiting["processor_status"], "requires_action", "{waiting}");
    // A refund meanwhile: 409 naming the top-up's state (not a key in flight: this key was
    // never used), a longer Retry-After, and nothing stored under the key.
    let refund_key = new_key();
    let early = app
        .post(&format!("/top-ups/{id}/refund"), Some(&refund_key), &json!({}))
        .await;
    early.assert_problem(409, "request_in_progress");
    assert_eq!(early.body["title"], "Top-up still processing", "{}", early.body);
    assert!(
        early.body["detail"].as_str().unwrap().contains("still processing"),
        "{}",
        early.body
    );
    assert_eq!(early.header("retry-after"), Some("5"));
    assert_eq!(app.get(&format!("/idempotency-keys/{refund_key}")).await.status, 404);

    // The completer looks again, and cancels it once the action timeout has passed.
    let failed = wait_for_state(&app, &id, |s| s["status"] != "processing").await;
    assert_eq!(failed["status"], "failed", "{failed}");
    assert_eq!(failed["failure_code"], "authentication_required", "{failed}");
    let intent = failed["processor_payment_id"].as_str().unwrap();
    assert_eq!(stripe.intent(intent).await["status"], "canceled");
    assert!(proxy.seen().iter().any(|s| s.path.ends_with("/cancel")));
    let answer = app.top_up(&key, "main", AMOUNT, &card).await;
    answer.assert_problem(402, "card_declined");
    assert_eq!(answer.body["decline_code"], "authentication_required");
    assert!(answer.replayed());
    assert_eq!(app.balance("main").await, MAIN_BALANCE, "nothing credited");
    assert_eq!(stripe.succeeded_of(&id).await, 0, "nothing charged");
    // The same refund key now runs, and is refused for good: the top-up failed.
    let refused = app
        .post(&format!("/top-ups/{id}/refund"), Some(&refund_key), &json!({}))
        .await;
    refused.assert_problem(404, "not_found");
    assert!(
        refused.body["detail"]
            .as_str()
            .unwrap()
            .contains("a top-up that failed"),
        "{}",
        refused.body
    );
    assert_eq!(app.get(&format!("/idempotency-keys/{refund_key}")).await.status, 200);
    assert_eq!(app.balance("main").await, MAIN_BALANCE);
    assert_eq!(audit(&app, &stripe).await["clean"], true);
}

/// Found from outside: every look at a PaymentIntent in `processing` counted, a client's
/// retry too, and each doubled the completer's interval: eight retries as `Retry-After: 5`
/// told moved its next look an hour away, so a card charged meanwhile waited that long for its
/// credit once the client stopped asking. A client's look records what it saw and counts
/// nothing (migrations/V38).
#[tokio::test]
async fn a_clients_retries_while_a_payment_intent_is_processing_put_the_completers_look_off_by_nothing() {
    let Rig {
        stripe: _stripe,
        app,
        proxy: _proxy,
    } = rig_with(
        StripeRules::with_processing_looks(10),
        |_: &Incoming| Action::Forward,
        |s| s.completer_after = Duration::from_secs(30),
    )
    .await;
    let key = new_key();
    app.top_up(&key, "main", AMOUNT, VISA)
        .await
        .assert_problem(503, "temporarily_unavailable");
    let (id, _) = app.top_up_of_key(&key).await.unwrap();
    let schedule = async || -> (i32, chrono::DateTime<chrono::Utc>) {
        sqlx::query_as("SELECT checks, next_check_at FROM top_ups WHERE tenant_id = $1 AND top_up_id = $2::uuid")
            .bind(app.tenant_id)
            .bind(&id)
            .fetch_one(&app.pool)
            .await
            .unwrap()
    };
    let (checks, first_next) = schedule().await;
    assert_eq!(checks, 1, "the first request's wait counts");
    for _ in 0..4 {
        let retry = app.top_up(&key, "main", AMOUNT, VISA).await;
        retry.assert_problem(503, "temporarily_unavailable");
    }
    let (checks, next) = schedule().await;
    assert_eq!(checks, 1, "four retries counted no look");
    assert!(
        next <= first_next,
        "the completer's look stays at {first_next}, not {next}"
    );
}

#[tokio::test]
async fn a_payment_intent_in_processing_is_shown_and_looked_at_again_until_it_succeeds() {
    let Rig {
        stripe,
        app,
        proxy: _proxy,
    } = rig_with(
        StripeRules::with_processing_looks(2),
        |_: &Incoming| Action::Forward,
        |s| s.completer_after = Duration::from_secs(1),
    )
    .await;
    let key = new_key();
    app.top_up(&key, "main", AMOUNT, VISA)
        .await
        .assert_problem(503, "temporarily_unavailable");
    let (id, _) = app.top_up_of_key(&key).await.unwrap();
    let shown = app.get(&format!("/top-ups/{id}")).await.body;
    assert_eq!(
        (&shown["status"], &shown["processor_status"]),
        (&json!("processing"), &json!("processing")),
        "{shown}"
    );
    let (checks, next): (i32, Option<chrono::DateTime<chrono::Utc>>) =
        sqlx::query_as("SELECT checks, next_check_at FROM top_ups WHERE tenant_id = $1 AND top_up_id = $2::uuid")
            .bind(app.tenant_id)
            .bind(&id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(checks, 1);
    assert!(next.is_some(), "its next look is scheduled");
    let done = wait_for_state(&app, &id, |s| s["status"] != "processing").await;
    assert_eq!(done["status"], "succeeded", "{done}");
    let answer = app.top_up(&key, "main", AMOUNT, VISA).await;
    assert_eq!(answer.status, 201, "{}", answer.body);
    assert_exactly_once(&app, &stripe, &id, true).await;
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("oncepay_top_up_oldest_unfinished_seconds"),
        "{metrics}"
    );
    assert!(
        metrics.contains("oncepay_completer_operations_total{result=\"waiting\"}"),
        "{metrics}"
    );
}

/// `oncepay_requests_total` of one outcome, all routes.
fn requests_of(metrics: &str, outcome: &str) -> u64 {
    let label = format!("outcome=\"{outcome}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with("oncepay_requests_total{") && l.contains(&label))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum()
}

/// A refund the processor answers `pending`, then `end` after two looks.
async fn pending_refund(end: &'static str) -> (Rig, String, String) {
    let rig = rig_with(
        StripeRules::with_refunds_pending_then(2, end),
        |_: &Incoming| Action::Forward,
        |s| s.completer_after = Duration::from_secs(1),
    )
    .await;
    let created = rig.app.top_up(&new_key(), "main", AMOUNT, VISA).await;
    assert_eq!(created.status, 201, "{}", created.body);
    let id = created.body["id"].as_str().unwrap().to_owned();
    let key = new_key();
    let pending = rig.app.refund_top_up(&key, &id).await;
    assert_eq!(pending.status, 202, "{}", pending.body);
    // Where to look, and when (found from outside: the 202 said neither).
    assert_eq!(pending.header("location"), Some(format!("/top-ups/{id}").as_str()));
    assert_eq!(pending.header("retry-after"), Some("5"));
    assert_eq!(
        pending.body,
        json!({"id": id, "status": "refund_pending", "refunded": AMOUNT, "balance": MAIN_BALANCE})
    );
    let shown = rig.app.get(&format!("/top-ups/{id}")).await.body;
    assert_eq!(shown["status"], "refund_pending", "{shown}");
    let metrics = rig.app.metrics().await;
    assert_eq!(
        requests_of(&metrics, "pending"),
        1,
        "counted as not finished: {metrics}"
    );
    assert_eq!(rig.app.balance("main").await, MAIN_BALANCE, "debited while pending");
    (rig, id, key)
}

/// A replica without a card processor (ONCEPAY_PROCESSOR_URL unset, as during a rollout or on
/// one misconfigured replica) answers a retry whose key stored an answer as any replica does:
/// found from outside, a charged top-up's replay there answered 501, which a client takes for
/// a final refusal. A new request there is still 501, with nothing claimed.
#[tokio::test]
async fn a_replica_without_a_processor_answers_what_a_key_stored() {
    let Rig {
        stripe,
        app,
        proxy: _proxy,
    } = rig(|_: &Incoming| Action::Forward, |_| {}).await;
    let bare = TestApp::builder()
        .with_tenant(app.tenant_id, app.api_key.clone())
        .spawn()
        .await;
    let key = new_key();
    let made = app.top_up(&key, "main", AMOUNT, VISA).await;
    assert_eq!(made.status, 201, "{}", made.body);
    let replay = bare.top_up(&key, "main", AMOUNT, VISA).await;
    assert_eq!(replay.status, 201, "{}", replay.body);
    assert!(replay.replayed());
    assert_eq!(replay.body, made.body);
    assert_eq!(replay.header("location"), made.header("location"));
    bare.top_up(&key, "main", AMOUNT + 1, VISA)
        .await
        .assert_problem(422, "idempotency_key_reused");
    // A stored decline, and a refund.
    let declined = new_key();
    app.top_up(&declined, "nobody", AMOUNT, VISA)
        .await
        .assert_problem(404, "account_not_found");
    let again = bare.top_up(&declined, "nobody", AMOUNT, VISA).await;
    again.assert_problem(404, "account_not_found");
    assert!(again.replayed());
    let id = made.body["id"].as_str().unwrap().to_owned();
    let refund_key = new_key();
    let refunded = app.refund_top_up(&refund_key, &id).await;
    assert_eq!(refunded.status, 200, "{}", refunded.body);
    let replay = bare.refund_top_up(&refund_key, &id).await;
    assert_eq!((replay.status, &replay.body), (200, &refunded.body));
    assert!(replay.replayed());
    // A top-up still processing (3-D Secure): not known here, named, never 501.
    let card = stripe.card(AUTHENTICATION_REQUIRED).await;
    let waiting = new_key();
    app.top_up(&waiting, "main", AMOUNT, &card)
        .await
        .assert_problem(503, "temporarily_unavailable");
    let (waiting_id, _) = app.top_up_of_key(&waiting).await.unwrap();
    let unknown = bare.top_up(&waiting, "main", AMOUNT, &card).await;
    unknown.assert_problem(503, "temporarily_unavailable");
    assert_eq!(
        unknown.header("location"),
        Some(format!("/top-ups/{waiting_id}").as_str())
    );
    // New requests: nothing to replay, nothing claimed.
    let keys = app.key_count().await;
    bare.top_up(&new_key(), "main", AMOUNT, VISA)
        .await
        .assert_problem(501, "processor_not_configured");
    bare.refund_top_up(&new_key(), &waiting_id)
        .await
        .assert_problem(501, "processor_not_configured");
    assert_eq!(app.key_count().await, keys, "nothing claimed");
}

/// A key stored as a replica before V42 stored a second refund's key while the first was
/// under way: 409 `already_refunded`, made from the row of the refund under `like` (its
/// fingerprint: the same request).
async fn stored_as_before_v42(app: &TestApp, like: &str) -> String {
    let key = new_key();
    let made = sqlx::query(
        "INSERT INTO idempotency_keys (tenant_id, key, fingerprint, method, path, status, resource_id, error_code, created_at, expires_at, operation)
         SELECT tenant_id, $3, fingerprint, method, path, 409, NULL, 'already_refunded', created_at, expires_at, operation
           FROM idempotency_keys WHERE tenant_id = $1 AND key = $2",
    )
    .bind(app.tenant_id)
    .bind(like)
    .bind(&key)
    .execute(&app.pool)
    .await
    .unwrap();
    assert_eq!(made.rows_affected(), 1);
    let answer = app.get(&format!("/idempotency-keys/{key}")).await;
    assert_eq!(answer.body["status"], 409, "{}", answer.body);
    key
}

/// migrations/V43, run again (it deletes only what no replica stores since V42).
async fn forget_wrong_already_refunded(app: &TestApp) {
    sqlx::raw_sql(include_str!(
        "../../migrations/V43__forget_a_wrong_already_refunded.sql"
    ))
    .execute(&app.pool)
    .await
    .unwrap();
}

/// Also: a refund under another key while the first is pending is answered 409 "under way"
/// and stores nothing (found from outside: it stored 409 `already_refunded`, which its key
/// kept answering after the first refund failed and was credited back); once the first has
/// failed, that key refunds the top-up.
#[tokio::test]
async fn a_refund_pending_then_failed_credits_the_amount_back_with_its_event() {
    let (Rig { stripe, proxy, app }, id, key) = pending_refund("failed").await;
    let second_key = new_key();
    let second = app.refund_top_up(&second_key, &id).await;
    second.assert_problem(409, "request_in_progress");
    assert_eq!(second.body["title"], "Refund under way", "{}", second.body);
    assert!(second.header("retry-after").is_some(), "{}", second.body);
    // The same words to a keyless refund (policy `allow`): they name no key it lacks.
    let detail = second.body["detail"].as_str().unwrap();
    assert!(!detail.contains("Idempotency-Key"), "{detail}");
    assert_eq!(
        app.get(&format!("/idempotency-keys/{second_key}")).await.status,
        404,
        "nothing stored under the second key"
    );
    let receiver = crate::support::webhook_receiver::Receiver::start().await;
    let endpoint = app
        .post(
            "/webhook-endpoints",
            Some(&new_key()),
            &json!({ "url": receiver.url() }),
        )
        .await;
    assert_eq!(endpoint.status, 201, "{}", endpoint.body);

    let ended = wait_for_state(&app, &id, |s| s["status"] != "refund_pending").await;
    assert_eq!(ended["status"], "succeeded", "{ended}");
    assert_eq!(ended["refund_failure_code"], "expired_or_canceled_card", "{ended}");
    assert_eq!(app.balance("main").await, MAIN_BALANCE + AMOUNT, "credited back");
    let answer = app.refund_top_up(&key, &id).await;
    answer.assert_problem(402, "refund_failed");
    assert!(answer.replayed());
    let events: Vec<String> = sqlx::query_scalar(
        "SELECT event_type::text FROM webhook_events WHERE tenant_id = $1 AND resource_id = $2 ORDER BY sequence",
    )
    .bind(app.tenant_id)
    .bind(&id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(events, ["top_up.refund_failed"], "written when it was credited back");
    let report = audit(&app, &stripe).await;
    assert_eq!(report["clean"], true, "{report:#}");
    assert!(proxy.seen().iter().filter(|s| s.path == "/v1/refunds").count() == 1);
    // A key stored "already refunded" before V42 for this top-up, not refunded: V43 forgets
    // it, and its retry refunds as the second key's does (found from outside: stored under
    // V40, it kept answering 409 already_refunded after the upgrade).
    let stale = stored_as_before_v42(&app, &key).await;
    forget_wrong_already_refunded(&app).await;
    assert_eq!(
        app.get(&format!("/idempotency-keys/{stale}")).await.status,
        404,
        "forgotten"
    );
    // The first refund failed: the second key's retry refunds the top-up now.
    let again = app.refund_top_up(&second_key, &id).await;
    assert_eq!(again.status, 202, "a second refund, pending in turn: {}", again.body);
    assert_eq!(again.body["status"], "refund_pending", "{}", again.body);
}

#[tokio::test]
async fn a_refund_pending_then_succeeded_ends_refunded() {
    let (
        Rig {
            stripe,
            app,
            proxy: _proxy,
        },
        id,
        key,
    ) = pending_refund("succeeded").await;
    let ended = wait_for_state(&app, &id, |s| s["status"] != "refund_pending").await;
    assert_eq!(ended["status"], "refunded", "{ended}");
    let answer = app.refund_top_up(&key, &id).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.body["status"], "refunded");
    assert_eq!(app.balance("main").await, MAIN_BALANCE);
    assert_eq!(audit(&app, &stripe).await["clean"], true);
    // "Already refunded" of a top-up refunded is right, however it was stored: V43 keeps it.
    let kept = stored_as_before_v42(&app, &key).await;
    forget_wrong_already_refunded(&app).await;
    let again = app.refund_top_up(&kept, &id).await;
    again.assert_problem(409, "already_refunded");
    assert!(again.replayed(), "{}", again.body);
}

/// The CLI prints a 202 `refund_pending` as any answer, but exits 4 with the key to look again
/// with (the same command), and 0 once the refund is done.
#[tokio::test]
async fn the_cli_says_a_pending_refund_is_not_final_and_the_same_command_looks_again() {
    let Rig {
        stripe,
        app,
        proxy: _proxy,
    } = rig_with(
        StripeRules::with_refunds_pending_then(2, "succeeded"),
        |_: &Incoming| Action::Forward,
        |s| s.completer_after = Duration::from_secs(1),
    )
    .await;
    let created = app.top_up(&new_key(), "main", AMOUNT, VISA).await;
    assert_eq!(created.status, 201, "{}", created.body);
    let id = created.body["id"].as_str().unwrap().to_owned();
    let key = new_key();
    let mut args = crate::cli::server_args(&app.address, &app);
    args.extend(["refund-top-up", "--top-up", &id, "--key", &key]);
    args.rotate_left(4);
    let pending = crate::cli::oncepay(&args, &[]).await;
    assert_eq!(pending.status, 4, "{}", pending.stderr);
    assert_eq!(pending.json()["status"], "refund_pending", "{}", pending.stdout);
    assert!(
        pending.stderr.contains("not final") && pending.stderr.contains(&format!("--key {key}")),
        "{}",
        pending.stderr
    );

    let ended = wait_for_state(&app, &id, |s| s["status"] != "refund_pending").await;
    assert_eq!(ended["status"], "refunded", "{ended}");
    let done = crate::cli::oncepay(&args, &[]).await;
    assert_eq!(done.status, 0, "{}", done.stderr);
    assert_eq!(done.json()["status"], "refunded", "{}", done.stdout);
    assert!(!done.stderr.contains("not final"), "{}", done.stderr);
    assert_eq!(app.balance("main").await, MAIN_BALANCE);
    assert_eq!(audit(&app, &stripe).await["clean"], true);
}

#[tokio::test]
async fn a_refund_the_processor_refuses_is_a_stored_failure_with_the_amount_credited_back() {
    let refusal = Action::StripeError {
        status: 400,
        kind: "invalid_request_error",
        code: "charge_disputed",
    };
    let Rig { stripe, proxy, app } = rig(first(Call::Refund, 1, refusal), |_| {}).await;
    let created = app.top_up(&new_key(), "main", AMOUNT, VISA).await;
    let id = created.body["id"].as_str().unwrap().to_owned();
    let key = new_key();
    let refused = app.refund_top_up(&key, &id).await;
    refused.assert_problem(402, "refund_failed");
    assert!(app.refund_top_up(&key, &id).await.replayed());
    assert_eq!(app.balance("main").await, MAIN_BALANCE + AMOUNT, "credited back");
    let shown = app.get(&format!("/top-ups/{id}")).await.body;
    assert_eq!(
        (&shown["status"], &shown["refund_failure_code"]),
        (&json!("succeeded"), &json!("charge_disputed"))
    );
    // Refundable again, under the refund's next key at the processor.
    let again = app.refund_top_up(&new_key(), &id).await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(app.balance("main").await, MAIN_BALANCE);
    assert!(proxy
        .seen()
        .iter()
        .any(|s| s.key.as_deref() == Some(&format!("oncepay-top-up-{id}-refund-1") as &str)));
    assert_eq!(audit(&app, &stripe).await["clean"], true);
}

/// A top-up left unfinished by a server whose `ONCEPAY_PROCESSOR_URL` is spelled otherwise
/// (`localhost` for `127.0.0.1`, a trailing slash): the same processor, named alike, so the
/// other replica's completer finishes it.
#[tokio::test]
async fn another_spelling_of_the_processors_url_strands_no_top_up() {
    let Rig { stripe, proxy, app } = rig(first(Call::Confirm, 1, Action::Swallow), |s| {
        s.completer_after = Duration::from_secs(1);
    })
    .await;
    let respelled = format!("{}/", proxy.url.replace("127.0.0.1", "localhost"));
    let doomed = ServerProcess::start_named(&respelled, &crate::top_ups::processor_name(&proxy.url)).await;
    let key = new_key();
    let client = reqwest::Client::new();
    let request = client
        .post(format!("{}/accounts/main/top-ups", doomed.url()))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", &key)
        .json(&json!({ "amount": AMOUNT, "payment_method": VISA }))
        .send();
    let sent = tokio::spawn(request);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !proxy.arrived().iter().any(|(_, path)| path.ends_with("/confirm")) {
        assert!(Instant::now() < deadline, "the confirmation never left");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    doomed.kill_9().await;
    sent.abort();
    wait_for_status(&app, &key, "succeeded").await;
    let (id, _) = app.top_up_of_key(&key).await.unwrap();
    assert_exactly_once(&app, &stripe, &id, true).await;
}

/// The completer drives one top-up at a time and holds the lease of that one alone: three
/// top-ups left unfinished, each look held 400 ms, never two leased at once.
#[tokio::test]
async fn the_completer_leases_one_top_up_at_a_time() {
    let plan = {
        let lost = first(Call::Confirm, 3, Action::DropAnswer);
        move |incoming: &Incoming| {
            if incoming.method == "GET" && incoming.path.starts_with("/v1/payment_intents/") {
                Action::HoldRequest(Duration::from_millis(400))
            } else {
                lost(incoming)
            }
        }
    };
    let Rig {
        stripe,
        app,
        proxy: _proxy,
    } = rig(plan, |s| s.completer_after = Duration::from_secs(1)).await;
    let mut keys = Vec::new();
    for _ in 0..3 {
        let key = new_key();
        app.top_up(&key, "main", AMOUNT, VISA)
            .await
            .assert_problem(503, "temporarily_unavailable");
        keys.push(key);
    }
    let mut most = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (leased, unfinished): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE lease_expires_at > now()), count(*) FILTER (WHERE status = 'processing')
               FROM top_ups WHERE tenant_id = $1",
        )
        .bind(app.tenant_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
        most = most.max(leased);
        if unfinished == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the completer did not finish them");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(most, 1, "leased at once");
    for key in &keys {
        let (id, _) = app.top_up_of_key(key).await.unwrap();
        assert_eq!(stripe.succeeded_of(&id).await, 1);
    }
    assert_eq!(app.balance("main").await, MAIN_BALANCE + 3 * AMOUNT);
}
