//! `oncepay_open_account`, through the `OpenAccount` effect: created, its decline, replayed, key reused,
//! expired.

use oncepay::operation::Decline;

use super::{assert_declined, assert_expired, assert_key_reused, assert_success_replayed, created, open_account, Fx};
use crate::support::helpers::MAIN_BALANCE;

#[tokio::test]
async fn open_account_created_writes_the_account_with_its_opening_balance() {
    let fx = Fx::new().await;

    let (row, key) = created(&fx, &open_account("savings", 700), "/accounts").await;

    assert_eq!(
        (row.account_id.as_str(), *row.balance, *row.opening_balance),
        ("savings", 700, 700)
    );
    assert_eq!(fx.balance("savings").await, 700);
    assert_eq!(key.resource_id.as_deref(), Some("savings"));
    assert_eq!(fx.count("accounts").await, 2, "main and savings");
}

#[tokio::test]
async fn open_account_declines_account_exists_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    assert_declined(&fx, &open_account("main", 5), "/accounts", Decline::AccountExists).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE, "the existing account untouched");
}

#[tokio::test]
async fn open_account_replayed_answers_the_same_row_and_changes_nothing() {
    let fx = Fx::new().await;
    assert_success_replayed(&fx, &open_account("savings", 700), "/accounts").await;
}

#[tokio::test]
async fn open_account_key_reused_answers_without_effect() {
    let fx = Fx::new().await;
    assert_key_reused(
        &fx,
        &open_account("savings", 700),
        &open_account("other", 1),
        "/accounts",
    )
    .await;
    assert_eq!(fx.count("accounts").await, 2, "main and savings, no `other`");
}

#[tokio::test]
async fn open_account_expired_key_answers_without_effect() {
    let fx = Fx::new().await;
    assert_expired(&fx, &open_account("savings", 700), "/accounts").await;
    assert_eq!(fx.count("accounts").await, 2);
}
