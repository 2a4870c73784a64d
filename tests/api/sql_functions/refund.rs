//! `oncepay_refund`, through the `Refund` effect: created, its declines, replayed, key reused, expired.

use oncepay::domain::PaymentId;
use oncepay::ledger::Refund;
use oncepay::operation::Decline;

use super::{assert_declined, assert_expired, assert_key_reused, assert_success_replayed, created, refund_path, Fx};
use crate::support::helpers::MAIN_BALANCE;

#[tokio::test]
async fn refund_created_credits_the_account_back_and_marks_the_payment() {
    let fx = Fx::new().await;
    let payment = fx.paid(300).await;

    let (row, key) = created(&fx, &Refund { payment }, &refund_path(payment)).await;

    assert_eq!(fx.balance("main").await, MAIN_BALANCE);
    assert_eq!(row.payment_id, payment.get());
    assert!(row.refunded_at.is_some());
    assert_eq!(row.balance_after_refund, Some(MAIN_BALANCE));
    assert_eq!(key.resource_id, Some(payment.to_string()));
    let refunded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM payments WHERE tenant_id = $1 AND refunded_at IS NOT NULL")
            .bind(fx.tenant.get())
            .fetch_one(&fx.pool)
            .await
            .unwrap();
    assert_eq!(refunded, 1);
}

#[tokio::test]
async fn refund_declines_not_found_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    let payment = PaymentId::new_random();
    assert_declined(&fx, &Refund { payment }, &refund_path(payment), Decline::NotFound).await;
}

#[tokio::test]
async fn refund_declines_already_refunded_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    let payment = fx.paid(300).await;
    let path = refund_path(payment);
    created(&fx, &Refund { payment }, &path).await;

    assert_declined(&fx, &Refund { payment }, &path, Decline::AlreadyRefunded).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE, "credited back once");
}

#[tokio::test]
async fn refund_replayed_answers_the_same_row_and_changes_nothing() {
    let fx = Fx::new().await;
    let payment = fx.paid(300).await;
    assert_success_replayed(&fx, &Refund { payment }, &refund_path(payment)).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE);
}

#[tokio::test]
async fn refund_key_reused_answers_without_effect() {
    let fx = Fx::new().await;
    let (first, second) = (fx.paid(300).await, fx.paid(200).await);
    // The key of the first refund, sent again for another payment: another fingerprint.
    let path = refund_path(first);
    assert_key_reused(&fx, &Refund { payment: first }, &Refund { payment: second }, &path).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE - 200, "only the first refunded");
}

#[tokio::test]
async fn refund_expired_key_answers_without_effect() {
    let fx = Fx::new().await;
    let payment = fx.paid(300).await;
    assert_expired(&fx, &Refund { payment }, &refund_path(payment)).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE);
}
