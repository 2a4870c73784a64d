//! Transfers through `oncepay_client` and the `oncepay` CLI against a real server (contract
//! section 4). `POST /transfers` comes with the lead's issue-9 branch: until it is merged
//! these tests are ignored (`cargo nextest run --run-ignored only -E 'test(transfer)'`).

use oncepay_client::{ClientError, IdempotencyKey};

use crate::cli::{oncepay, run_twice, server_args};
use crate::client::{client_for, fast_config};
use crate::support::fault_proxy::{lose_the_first_answer, Action, FaultProxy};
use crate::support::helpers::{new_key, spawn_app, MAIN_BALANCE};

#[tokio::test]
async fn a_transfer_whose_answer_is_lost_moves_the_money_once_and_the_retry_replays_it() {
    let app = spawn_app().await;
    app.open_account("u2", 0).await;
    let proxy = FaultProxy::start(&app.address, lose_the_first_answer).await;
    let client = client_for(&proxy.url, &app, fast_config());
    let key = IdempotencyKey::generate();

    let reply = client.transfer("main", "u2", 300, &key).await.expect("the transfer");

    assert!(reply.replayed && reply.attempts == 2, "{} attempts", reply.attempts);
    let transfer = &reply.value;
    assert_eq!(
        (
            reply.status,
            transfer.from.as_str(),
            transfer.to.as_str(),
            transfer.amount
        ),
        (201, "main", "u2", 300)
    );
    assert_eq!((transfer.from_balance, transfer.to_balance), (MAIN_BALANCE - 300, 300));
    let seen = proxy.seen();
    assert!(
        seen.iter()
            .all(|s| s.path == "/transfers" && s.key.as_deref() == Some(key.as_str()) && s.body == seen[0].body),
        "every attempt is the same request: {seen:?}"
    );
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 300);
    assert_eq!(app.balance("u2").await, 300);

    let state = client.get_transfer(transfer.id).await.expect("the transfer reads back");
    assert_eq!(
        (state.status, state.value.id, state.value.amount, state.value.created_at),
        (200, transfer.id, 300, transfer.created_at)
    );
    assert_eq!((state.value.from.as_str(), state.value.to.as_str()), ("main", "u2"));
}

#[tokio::test]
async fn transfer_declines_come_back_typed_after_one_attempt_and_replay_with_their_key() {
    let app = spawn_app().await;
    app.open_account("u2", 0).await;
    let proxy = FaultProxy::start(&app.address, |_| Action::Forward).await;
    let client = client_for(&proxy.url, &app, fast_config());
    let poor = IdempotencyKey::generate();

    let declines = [
        (
            client.transfer("main", "u2", MAIN_BALANCE + 1, &poor).await,
            402,
            "insufficient_funds",
        ),
        (
            client.transfer("main", "nobody", 1, &IdempotencyKey::generate()).await,
            404,
            "account_not_found",
        ),
        (
            client.transfer("main", "main", 1, &IdempotencyKey::generate()).await,
            400,
            "invalid_request",
        ),
    ];

    for (result, status, code) in declines {
        let err = result.expect_err(code);
        assert_eq!((err.status(), err.code()), (Some(status), code), "{err}");
        assert!(!err.outcome_unknown(), "a decline is a final answer: {err}");
    }
    assert_eq!(proxy.seen().len(), 3, "one attempt per decline");
    let again = client.transfer("main", "u2", MAIN_BALANCE + 1, &poor).await;
    let Err(ClientError::Problem(problem)) = again else {
        panic!("the stored decline: {again:?}");
    };
    assert!(problem.replayed && problem.code == "insufficient_funds", "{problem:?}");
    assert_eq!(app.balance("main").await, MAIN_BALANCE);
    assert_eq!(app.balance("u2").await, 0);
}

#[tokio::test]
async fn the_cli_transfer_prints_the_json_and_get_transfer_reads_it_back() {
    let app = spawn_app().await;
    app.open_account("u2", 0).await;
    let key = new_key();
    let mut args = vec!["transfer"];
    args.extend(server_args(&app.address, &app));
    args.extend(["--from", "main", "--to", "u2", "--amount", "250", "--key", &key]);

    let (first, second) = run_twice(&args).await;

    let transfer = first.json();
    assert_eq!(
        (&transfer["from"], &transfer["to"], &transfer["amount"]),
        (&"main".into(), &"u2".into(), &250.into())
    );
    assert_eq!(
        (transfer["from_balance"].as_i64(), transfer["to_balance"].as_i64()),
        (Some(MAIN_BALANCE - 250), Some(250))
    );
    assert_eq!(second.json(), transfer, "the stored answer");
    assert!(second.stderr.contains("replayed"), "{}", second.stderr);
    assert_eq!(app.balance("u2").await, 250, "moved once");

    let id = transfer["id"].as_str().expect("an id");
    let mut args = vec!["get-transfer", id];
    args.extend(server_args(&app.address, &app));
    let read = oncepay(&args, &[]).await;
    assert_eq!(read.status, 0, "stderr: {}", read.stderr);
    assert_eq!(read.json()["id"], id);
    assert_eq!(read.json()["amount"], 250);
}

#[tokio::test]
async fn the_cli_refuses_a_transfer_to_the_same_account_with_exit_3() {
    let app = spawn_app().await;
    let mut args = vec!["transfer"];
    args.extend(server_args(&app.address, &app));
    args.extend(["--from", "main", "--to", "main", "--amount", "1"]);

    let run = oncepay(&args, &[]).await;

    assert_eq!(run.status, 3, "stderr: {}", run.stderr);
    assert!(run.stdout.is_empty());
    assert!(run.stderr.contains("code=invalid_request status=400"), "{}", run.stderr);
    assert_eq!(app.balance("main").await, MAIN_BALANCE);
}
