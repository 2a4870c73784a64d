//! `oncepay_pay`, through the `Pay` effect: created, its declines, replayed, key reused, expired.

use oncepay::operation::Decline;

use super::{assert_declined, assert_expired, assert_key_reused, assert_success_replayed, created, pay, Fx};
use crate::support::helpers::MAIN_BALANCE;

#[tokio::test]
async fn pay_created_debits_the_account_and_writes_the_payment() {
    let fx = Fx::new().await;

    let (row, key) = created(&fx, &pay("main", 300), "/payments").await;

    assert_eq!(fx.balance("main").await, MAIN_BALANCE - 300);
    assert_eq!((row.account_id.as_str(), *row.amount), ("main", 300));
    assert_eq!(row.balance_after, MAIN_BALANCE - 300);
    assert_eq!((row.refunded_at, row.balance_after_refund), (None, None));
    assert_eq!(key.resource_id, Some(row.payment_id.to_string()));
    assert_eq!(fx.count("payments").await, 1);
}

#[tokio::test]
async fn pay_declines_insufficient_funds_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    assert_declined(
        &fx,
        &pay("main", MAIN_BALANCE + 1),
        "/payments",
        Decline::InsufficientFunds,
    )
    .await;
}

#[tokio::test]
async fn pay_declines_account_not_found_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    assert_declined(&fx, &pay("nobody", 1), "/payments", Decline::AccountNotFound).await;
}

#[tokio::test]
async fn pay_replayed_answers_the_same_row_and_changes_nothing() {
    let fx = Fx::new().await;
    assert_success_replayed(&fx, &pay("main", 300), "/payments").await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE - 300, "debited once");
}

#[tokio::test]
async fn pay_key_reused_answers_without_effect() {
    let fx = Fx::new().await;
    assert_key_reused(&fx, &pay("main", 300), &pay("main", 301), "/payments").await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE - 300);
}

#[tokio::test]
async fn pay_expired_key_answers_without_effect() {
    let fx = Fx::new().await;
    assert_expired(&fx, &pay("main", 300), "/payments").await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE - 300);
}
