//! `oncepay audit` with the processor configured, on every state a top-up row can be in, the
//! unfinished ones first (docs/top-ups.md, reconciliation): it always runs; a top-up unfinished
//! past the completer's window is reported with its age and its PaymentIntent's status at the
//! processor; one whose PaymentIntent succeeded while it is still processing is a broken
//! invariant naming the PaymentIntent. The rows are written directly, an hour old, beside real
//! PaymentIntents at localstripe.

use serde_json::Value;
use tokio::process::Command;
use uuid::Uuid;

use crate::support::helpers::{database_url, TestApp, MAIN_BALANCE};
use crate::support::stripe::{Localstripe, API_KEY};

const AMOUNT: i64 = 900;
const AUTHENTICATION_REQUIRED: &str = "4000002760003184";

struct Case {
    stripe: Localstripe,
    app: TestApp,
    top_up: Uuid,
}

impl Case {
    async fn new() -> Self {
        Self {
            stripe: Localstripe::start().await,
            app: TestApp::builder().spawn().await,
            top_up: Uuid::new_v4(),
        }
    }

    /// A PaymentIntent naming this top-up, confirmed when `confirm`; its id.
    async fn intent(&self, payment_method: &str, confirm: bool) -> String {
        let intent = self
            .stripe
            .intent_naming(&self.top_up.to_string(), AMOUNT, payment_method, confirm)
            .await;
        intent["id"].as_str().unwrap().to_owned()
    }

    /// The top-up row, an hour old, in the state `columns` set; and the account credited by
    /// `credited` (what the balance equation expects of that state).
    async fn row(&self, columns: &str, credited: i64) {
        sqlx::query(
            "INSERT INTO top_ups (tenant_id, top_up_id, account_id, amount, currency, payment_method, status,
                                  recovery_point, created_at, updated_at, processor)
             VALUES ($1, $2, 'main', $3, 'usd', 'pm_card_visa', 'processing', 'started',
                     now() - interval '1 hour', now() - interval '1 hour', 'audit-test')",
        )
        .bind(self.app.tenant_id)
        .bind(self.top_up)
        .bind(AMOUNT)
        .execute(&self.app.pool)
        .await
        .unwrap();
        if !columns.is_empty() {
            sqlx::query(&format!(
                "UPDATE top_ups SET {columns} WHERE tenant_id = $1 AND top_up_id = $2"
            ))
            .bind(self.app.tenant_id)
            .bind(self.top_up)
            .execute(&self.app.pool)
            .await
            .unwrap();
        }
        sqlx::query("UPDATE accounts SET balance = balance + $3 WHERE tenant_id = $1 AND account_id = $2")
            .bind(self.app.tenant_id)
            .bind("main")
            .bind(credited)
            .execute(&self.app.pool)
            .await
            .unwrap();
    }

    /// `oncepay audit` of the tenant, reading localstripe, with `extra` arguments.
    async fn run_audit(&self, extra: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .args(["audit", "--tenant", &self.app.tenant_id.to_string()])
            .args(extra)
            .env("DATABASE_URL", database_url())
            .env("ONCEPAY_PROCESSOR_URL", &self.stripe.url)
            .env("ONCEPAY_PROCESSOR_API_KEY", API_KEY)
            .env("ONCEPAY_COMPLETER_AFTER_SECS", "30")
            .output()
            .await
            .unwrap()
    }

    /// `oncepay audit --json` of the tenant: its exit status and report.
    async fn audit(&self) -> (i32, Value) {
        let output = self.run_audit(&["--json"]).await;
        let report = serde_json::from_slice(&output.stdout).unwrap_or_else(|_| {
            panic!(
                "the audit could not run: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )
        });
        (output.status.code().unwrap_or(-1), report)
    }

    /// The audit runs, is clean, and reports this top-up as unfinished (`state`, its
    /// PaymentIntent `at_processor`), or reports nothing when `state` is `None`.
    async fn assert_clean(&self, state: Option<(&str, Option<&str>)>) -> Value {
        let (status, report) = self.audit().await;
        assert_eq!(status, 0, "{report:#}");
        assert_eq!(report["clean"], true, "{report:#}");
        let unfinished = &report["warnings"]["unfinished_top_ups"];
        match state {
            None => assert_eq!(unfinished["count"], 0, "{report:#}"),
            Some((state, at_processor)) => {
                assert_eq!(unfinished["count"], 1, "{report:#}");
                let finding = &unfinished["samples"][0];
                assert_eq!(finding["top_up_id"], self.top_up.to_string());
                assert_eq!(finding["tenant_id"], self.app.tenant_id.to_string());
                assert_eq!(finding["state"], state);
                assert!(finding["age_secs"].as_i64().unwrap() >= 3_590, "{finding}");
                assert_eq!(finding["at_processor"].as_str(), at_processor, "{finding}");
            }
        }
        report
    }
}

#[tokio::test]
async fn the_audit_reports_a_top_up_processing_before_its_payment_intent_was_created() {
    let case = Case::new().await;
    case.row("", 0).await;
    let report = case.assert_clean(Some(("processing", None))).await;
    assert!(report["warnings"]["unfinished_top_ups"]["samples"][0]["processor_payment_id"].is_null());
}

#[tokio::test]
async fn the_audit_reports_a_top_up_processing_with_its_payment_intent_unconfirmed() {
    let case = Case::new().await;
    let intent = case.intent("pm_card_visa", false).await;
    case.row(
        &format!("recovery_point = 'intent_created', processor_payment_id = '{intent}'"),
        0,
    )
    .await;
    case.assert_clean(Some(("processing", Some("requires_confirmation"))))
        .await;
}

#[tokio::test]
async fn the_audit_reports_a_top_up_whose_payment_intent_waits_for_an_action() {
    let case = Case::new().await;
    let card = case.stripe.card(AUTHENTICATION_REQUIRED).await;
    let intent = case.intent(&card, true).await;
    case.row(
        &format!(
            "recovery_point = 'intent_created', processor_payment_id = '{intent}', processor_status = 'requires_action'"
        ),
        0,
    )
    .await;
    let report = case.assert_clean(Some(("processing", Some("requires_action")))).await;
    let finding = &report["warnings"]["unfinished_top_ups"]["samples"][0];
    assert_eq!(finding["last_seen_status"], "requires_action");
}

#[tokio::test]
async fn the_audit_fails_naming_the_payment_intent_of_a_top_up_charged_and_never_credited() {
    let case = Case::new().await;
    let intent = case.intent("pm_card_visa", true).await;
    case.row(
        &format!("recovery_point = 'intent_created', processor_payment_id = '{intent}'"),
        0,
    )
    .await;
    let (status, report) = case.audit().await;
    assert_eq!(status, oncepay::audit::EXIT_BROKEN, "{report:#}");
    assert_eq!(report["clean"], false);
    let broken = &report["invariants"]["top_ups"];
    assert_eq!(broken["count"], 1, "{report:#}");
    assert_eq!(broken["samples"][0]["processor_payment_id"], intent.as_str());
    assert!(
        broken["samples"][0]["problem"]
            .as_str()
            .unwrap()
            .contains("charged, not credited"),
        "{report:#}"
    );
    assert_eq!(
        report["warnings"]["unfinished_top_ups"]["samples"][0]["at_processor"],
        "succeeded"
    );
}

/// Succeeded (credited) over the PaymentIntent `intent`, an hour ago.
fn succeeded(intent: &str) -> String {
    format!(
        "status = 'succeeded', recovery_point = 'finished', processor_payment_id = '{intent}',
         balance_after = {MAIN_BALANCE} + {AMOUNT}, finished_at = now() - interval '1 hour'"
    )
}

/// A top-up credited whose PaymentIntent did not succeed, or that the processor does not know:
/// broken, and the finding says which.
#[tokio::test]
async fn the_audit_says_whether_a_credited_top_ups_payment_intent_failed_or_is_unknown() {
    for (unknown, says) in [
        (false, "is requires_confirmation at the processor"),
        (true, "lists no such PaymentIntent"),
    ] {
        let case = Case::new().await;
        let intent = if unknown {
            "pi_lost_by_the_processor".to_owned()
        } else {
            case.intent("pm_card_visa", false).await
        };
        case.row(&succeeded(&intent), AMOUNT).await;
        let (status, report) = case.audit().await;
        assert_eq!(status, oncepay::audit::EXIT_BROKEN, "{report:#}");
        let broken = &report["invariants"]["top_ups"];
        let problem = broken["samples"][0]["problem"].as_str().unwrap();
        assert!(problem.contains(says), "{report:#}");
        assert_eq!(broken["samples"][0]["processor_payment_id"], intent.as_str());
    }
}

/// Succeeded (credited), then a refund: `refund` sets its columns (and the status, when it is
/// no longer `succeeded`).
fn credited_then(intent: &str, refund: &str) -> String {
    let status = if refund.contains("status = 'refunded'") {
        ""
    } else {
        "status = 'succeeded', "
    };
    format!(
        "{status}recovery_point = 'finished', processor_payment_id = '{intent}',
         balance_after = {MAIN_BALANCE} + {AMOUNT}, finished_at = now() - interval '1 hour',
         refund_requested_at = now() - interval '1 hour', {refund}"
    )
}

/// Succeeded, then debited for a refund: the balance is as before both.
fn debited(intent: &str) -> String {
    credited_then(
        intent,
        &format!("refund_state = 'debited', balance_after_refund = {MAIN_BALANCE}"),
    )
}

#[tokio::test]
async fn the_audit_reports_a_refund_debited_and_not_yet_made_at_the_processor() {
    let case = Case::new().await;
    let intent = case.intent("pm_card_visa", true).await;
    case.row(&debited(&intent), 0).await;
    let report = case.assert_clean(Some(("refund_pending", Some("succeeded")))).await;
    assert!(report["warnings"]["unfinished_top_ups"]["samples"][0]["last_seen_status"].is_null());
}

#[tokio::test]
async fn the_audit_reports_a_refund_pending_at_the_processor() {
    let case = Case::new().await;
    let intent = case.intent("pm_card_visa", true).await;
    case.row(
        &format!(
            "{}, processor_refund_id = 're_1', refund_status = 'pending'",
            debited(&intent)
        ),
        0,
    )
    .await;
    let report = case.assert_clean(Some(("refund_pending", Some("succeeded")))).await;
    assert_eq!(
        report["warnings"]["unfinished_top_ups"]["samples"][0]["last_seen_status"],
        "pending"
    );
    // The text names the status it saw last as the refund's, not the PaymentIntent's
    // (found from outside: "PaymentIntent ... is succeeded (last seen pending)").
    let text = String::from_utf8(case.run_audit(&[]).await.stdout).unwrap();
    assert!(
        text.contains("is succeeded at the processor (its refund last seen pending)"),
        "{text}"
    );
}

#[tokio::test]
async fn the_audit_of_a_failed_top_up_is_clean() {
    let case = Case::new().await;
    let intent = case.intent("pm_card_chargeCustomerFail", false).await;
    case.row(
        &format!(
            "status = 'failed', recovery_point = 'finished', processor_payment_id = '{intent}',
             failure_code = 'card_declined', decline_code = 'card_declined', finished_at = now() - interval '1 hour'"
        ),
        0,
    )
    .await;
    case.assert_clean(None).await;
}

#[tokio::test]
async fn the_audit_of_a_succeeded_top_up_is_clean() {
    let case = Case::new().await;
    let intent = case.intent("pm_card_visa", true).await;
    case.row(&succeeded(&intent), AMOUNT).await;
    case.assert_clean(None).await;
}

#[tokio::test]
async fn the_audit_of_a_refunded_top_up_is_clean() {
    let case = Case::new().await;
    let intent = case.intent("pm_card_visa", true).await;
    case.row(
        &credited_then(
            &intent,
            &format!(
                "status = 'refunded', refund_state = 'refunded', balance_after_refund = {MAIN_BALANCE},
                 refund_status = 'succeeded', processor_refund_id = 're_1', refunded_at = now() - interval '1 hour'"
            ),
        ),
        0,
    )
    .await;
    case.assert_clean(None).await;
}

#[tokio::test]
async fn the_audit_of_a_top_up_whose_refund_failed_and_was_credited_back_is_clean() {
    let case = Case::new().await;
    let intent = case.intent("pm_card_visa", true).await;
    case.row(
        &credited_then(
            &intent,
            "refund_status = 'failed', refund_failure_code = 'expired_or_canceled_card', processor_refund_id = 're_1'",
        ),
        AMOUNT,
    )
    .await;
    case.assert_clean(None).await;
}
