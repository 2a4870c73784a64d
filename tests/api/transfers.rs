//! `POST /transfers`: atomic, idempotent like every POST, declines stored and replayed, and
//! opposite transfers on several instances never deadlock.

use std::time::Duration;

use futures_util::future::join_all;

use crate::support::helpers::{new_key, spawn_app, spawn_instances, MAIN_BALANCE};

#[tokio::test]
async fn a_transfer_moves_the_amount_and_answers_both_balances() {
    let app = spawn_app().await;
    app.open_account("savings", 0).await;

    let answer = app.transfer(Some(&new_key()), "main", "savings", 300).await;

    assert_eq!(answer.status, 201, "{}", answer.body);
    assert_eq!(answer.body["from"], "main");
    assert_eq!(answer.body["to"], "savings");
    assert_eq!(answer.body["amount"], 300);
    assert_eq!(answer.body["from_balance"], MAIN_BALANCE - 300);
    assert_eq!(answer.body["to_balance"], 300);
    assert_eq!(answer.header("idempotency-replayed"), Some("false"));
    let id = answer.body["id"].as_str().unwrap();
    assert_eq!(answer.header("location"), Some(format!("/transfers/{id}").as_str()));
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 300);
    assert_eq!(app.balance("savings").await, 300);

    let current = app.get(&format!("/transfers/{id}")).await;
    assert_eq!(current.status, 200);
    assert_eq!(current.body["amount"], 300);
    assert_eq!(current.body["from"], "main");
    assert_eq!(current.body["created_at"], answer.body["created_at"]);
}

#[tokio::test]
async fn a_retried_transfer_replays_the_first_answer_and_moves_nothing_more() {
    let app = spawn_app().await;
    app.open_account("savings", 0).await;
    let key = new_key();

    let first = app.transfer(Some(&key), "main", "savings", 100).await;
    app.transfer(Some(&new_key()), "main", "savings", 50).await;
    let again = app.transfer(Some(&key), "main", "savings", 100).await;

    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotency-replayed"), Some("true"));
    assert_eq!(
        again.body, first.body,
        "the values of the first answer, not the current ones"
    );
    assert_eq!(app.balance("savings").await, 150);
}

#[tokio::test]
async fn declined_transfers_are_stored_and_replayed_and_change_nothing() {
    let app = spawn_app().await;
    app.open_account("savings", 0).await;
    let poor = new_key();
    let nowhere = new_key();

    let too_much = app.transfer(Some(&poor), "main", "savings", MAIN_BALANCE + 1).await;
    let unknown = app.transfer(Some(&nowhere), "main", "nowhere", 1).await;
    app.deposit(Some(&new_key()), "main", MAIN_BALANCE).await;
    let too_much_again = app.transfer(Some(&poor), "main", "savings", MAIN_BALANCE + 1).await;
    app.open_account("nowhere", 0).await;
    let unknown_again = app.transfer(Some(&nowhere), "main", "nowhere", 1).await;

    too_much.assert_problem(402, "insufficient_funds");
    unknown.assert_problem(404, "account_not_found");
    too_much_again.assert_problem(402, "insufficient_funds");
    assert_eq!(too_much_again.header("idempotency-replayed"), Some("true"));
    unknown_again.assert_problem(404, "account_not_found");
    assert_eq!(
        app.balance("main").await,
        2 * MAIN_BALANCE,
        "only the deposit moved money"
    );
    assert_eq!(app.balance("savings").await, 0);
}

#[tokio::test]
async fn a_transfer_to_the_same_account_is_refused_before_the_key_is_claimed() {
    let app = spawn_app().await;
    let key = new_key();

    let answer = app.transfer(Some(&key), "main", "main", 10).await;

    answer.assert_problem(400, "invalid_request");
    assert_eq!(app.key_count().await, 0, "nothing stored");
    assert_eq!(app.balance("main").await, MAIN_BALANCE);
}

#[tokio::test]
async fn another_body_under_a_transfer_key_is_refused() {
    let app = spawn_app().await;
    app.open_account("savings", 0).await;
    let key = new_key();
    app.transfer(Some(&key), "main", "savings", 10).await;

    app.transfer(Some(&key), "main", "savings", 11)
        .await
        .assert_problem(422, "idempotency_key_reused");
    app.pay(Some(&key), 10)
        .await
        .assert_problem(422, "idempotency_key_reused");
    assert_eq!(app.balance("savings").await, 10);
}

#[tokio::test]
async fn another_tenants_transfer_is_not_found() {
    let app = spawn_app().await;
    let other = spawn_app().await;
    app.open_account("savings", 0).await;
    let answer = app.transfer(Some(&new_key()), "main", "savings", 10).await;
    let id = answer.body["id"].as_str().unwrap();

    other
        .get(&format!("/transfers/{id}"))
        .await
        .assert_problem(404, "not_found");
    other
        .get("/transfers/not-a-uuid")
        .await
        .assert_problem(404, "not_found");
}

/// Opposite transfers between the same two accounts, at once, over three instances: the
/// accounts are locked in one order, so none deadlocks (no 5xx) and no money is created or
/// lost. Like a client, a transfer answered 429 (pool at capacity) or 409 (in progress) is
/// retried with its key.
#[tokio::test]
async fn hundreds_of_opposite_concurrent_transfers_over_three_instances_never_deadlock() {
    let apps = spawn_instances(3).await;
    apps[0].open_account("a", 100_000).await;
    apps[0].open_account("b", 100_000).await;
    let total_before = apps[0].balance("a").await + apps[0].balance("b").await;

    let answers = join_all((0..300).map(|i| {
        let (from, to) = if i % 2 == 0 { ("a", "b") } else { ("b", "a") };
        let app = &apps[i % 3];
        async move {
            let key = new_key();
            let mut answer = app.transfer(Some(&key), from, to, 1 + (i as i64 % 7)).await;
            for _ in 0..50 {
                assert!(
                    answer.status < 500,
                    "a transfer answered {}: {}",
                    answer.status,
                    answer.body
                );
                if !matches!(answer.status, 409 | 429) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                answer = app.transfer(Some(&key), from, to, 1 + (i as i64 % 7)).await;
            }
            answer
        }
    }))
    .await;

    for answer in &answers {
        assert_eq!(answer.status, 201, "{}", answer.body);
    }
    let moved: i64 = (0..300i64)
        .map(|i| if i % 2 == 0 { 1 + i % 7 } else { -(1 + i % 7) })
        .sum();
    assert_eq!(apps[0].balance("a").await, 100_000 - moved);
    assert_eq!(apps[0].balance("a").await + apps[0].balance("b").await, total_before);
}
