//! `oncepay_deposit`, through the `Deposit` effect: created, its decline, replayed, key reused, expired.

use oncepay::operation::{Decline, Operation};

use super::{assert_declined, assert_expired, assert_key_reused, assert_success_replayed, created, deposit, Fx};
use crate::support::helpers::MAIN_BALANCE;

#[tokio::test]
async fn deposit_created_credits_the_account_and_writes_the_deposit() {
    let fx = Fx::new().await;
    let path = Operation::Deposit.spec().path_with("main");

    let (row, key) = created(&fx, &deposit("main", 250), &path).await;

    assert_eq!(fx.balance("main").await, MAIN_BALANCE + 250);
    assert_eq!((row.account_id.as_str(), *row.amount), ("main", 250));
    assert_eq!(row.balance_after, MAIN_BALANCE + 250);
    assert_eq!(key.resource_id, Some(row.deposit_id.to_string()));
    assert_eq!(fx.count("deposits").await, 1);
}

#[tokio::test]
async fn deposit_declines_account_not_found_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    let path = Operation::Deposit.spec().path_with("nobody");
    assert_declined(&fx, &deposit("nobody", 250), &path, Decline::AccountNotFound).await;
}

#[tokio::test]
async fn deposit_replayed_answers_the_same_row_and_changes_nothing() {
    let fx = Fx::new().await;
    let path = Operation::Deposit.spec().path_with("main");
    assert_success_replayed(&fx, &deposit("main", 250), &path).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE + 250, "credited once");
}

#[tokio::test]
async fn deposit_key_reused_answers_without_effect() {
    let fx = Fx::new().await;
    let path = Operation::Deposit.spec().path_with("main");
    assert_key_reused(&fx, &deposit("main", 250), &deposit("main", 251), &path).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE + 250);
}

#[tokio::test]
async fn deposit_expired_key_answers_without_effect() {
    let fx = Fx::new().await;
    let path = Operation::Deposit.spec().path_with("main");
    assert_expired(&fx, &deposit("main", 250), &path).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE + 250);
}
