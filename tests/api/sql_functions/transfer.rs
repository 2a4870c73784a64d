//! `oncepay_transfer`, through the `Transfer` effect: the outcomes, then its lock order, parallel
//! opposite transfers, and a transfer to the same account refused in SQL.

use futures_util::future::join_all;
use oncepay::domain::TenantId;
use oncepay::ledger::{Effect, Outcome, Reply, Transfer};
use oncepay::operation::{Decline, Operation};
use sqlx::{Connection, PgConnection};

use super::{
    args, assert_declined, assert_expired, assert_key_reused, assert_success_replayed, backend_pid, claim_args,
    client_claim, created, fp, sqlstate, transfer, wait_until_blocked, Fx, WAIT,
};
use crate::support::helpers::{new_key, MAIN_BALANCE};

#[tokio::test]
async fn transfer_created_moves_the_amount_and_writes_the_transfer() {
    let fx = Fx::new().await;
    fx.open("u2", 50).await;

    let (row, key) = created(&fx, &transfer("main", "u2", 300), "/transfers").await;

    assert_eq!(fx.balance("main").await, MAIN_BALANCE - 300);
    assert_eq!(fx.balance("u2").await, 350);
    assert_eq!(
        (row.from_account_id.as_str(), row.to_account_id.as_str(), *row.amount),
        ("main", "u2", 300)
    );
    assert_eq!(
        (*row.from_balance_after, *row.to_balance_after),
        (MAIN_BALANCE - 300, 350)
    );
    assert_eq!(key.resource_id, Some(row.transfer_id.to_string()));
    assert_eq!(fx.count("transfers").await, 1);
}

#[tokio::test]
async fn transfer_declines_insufficient_funds_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    fx.open("u2", 50).await;
    let effect = transfer("main", "u2", MAIN_BALANCE + 1);
    assert_declined(&fx, &effect, "/transfers", Decline::InsufficientFunds).await;
}

#[tokio::test]
async fn transfer_declines_account_not_found_for_either_side_changing_nothing() {
    let fx = Fx::new().await;
    assert_declined(
        &fx,
        &transfer("main", "nobody", 1),
        "/transfers",
        Decline::AccountNotFound,
    )
    .await;
    assert_declined(
        &fx,
        &transfer("nobody", "main", 1),
        "/transfers",
        Decline::AccountNotFound,
    )
    .await;
}

#[tokio::test]
async fn transfer_replayed_answers_the_same_row_and_changes_nothing() {
    let fx = Fx::new().await;
    fx.open("u2", 0).await;
    assert_success_replayed(&fx, &transfer("main", "u2", 300), "/transfers").await;
    assert_eq!(
        (fx.balance("main").await, fx.balance("u2").await),
        (MAIN_BALANCE - 300, 300)
    );
}

#[tokio::test]
async fn transfer_key_reused_answers_without_effect() {
    let fx = Fx::new().await;
    fx.open("u2", 0).await;
    assert_key_reused(
        &fx,
        &transfer("main", "u2", 300),
        &transfer("u2", "main", 300),
        "/transfers",
    )
    .await;
    assert_eq!(
        (fx.balance("main").await, fx.balance("u2").await),
        (MAIN_BALANCE - 300, 300)
    );
}

#[tokio::test]
async fn transfer_expired_key_answers_without_effect() {
    let fx = Fx::new().await;
    fx.open("u2", 0).await;
    assert_expired(&fx, &transfer("main", "u2", 300), "/transfers").await;
    assert_eq!(
        (fx.balance("main").await, fx.balance("u2").await),
        (MAIN_BALANCE - 300, 300)
    );
}

/// With the lower account id locked elsewhere, a transfer waits for it holding no lock on
/// the higher one, whichever side the lower id is on: the two rows are locked in account-id
/// order, not in from/to order.
#[tokio::test]
async fn transfer_locks_its_two_accounts_in_account_id_order() {
    let fx = Fx::new().await;
    fx.open("acct-a", 1_000).await;
    fx.open("acct-z", 1_000).await;
    for (from, to) in [("acct-z", "acct-a"), ("acct-a", "acct-z")] {
        let mut holder = fx.pool.begin().await.unwrap();
        let holder_pid = backend_pid(&mut holder).await;
        sqlx::query("SELECT FROM accounts WHERE tenant_id = $1 AND account_id = 'acct-a' FOR UPDATE")
            .bind(fx.tenant.get())
            .execute(&mut *holder)
            .await
            .unwrap();

        let mut conn = fx.pool.acquire().await.unwrap();
        let pid = backend_pid(&mut conn).await;
        let (effect, tenant) = (transfer(from, to, 10), fx.tenant);
        let effect_args = args(&effect, "/transfers", &new_key());
        let running = tokio::spawn(async move { effect.run(&mut conn, tenant, &effect_args).await });
        wait_until_blocked(&fx.pool, pid, holder_pid).await;

        let mut probe = fx.pool.begin().await.unwrap();
        let free = sqlx::query("SELECT FROM accounts WHERE tenant_id = $1 AND account_id = 'acct-z' FOR UPDATE NOWAIT")
            .bind(fx.tenant.get())
            .execute(&mut *probe)
            .await;
        probe.rollback().await.unwrap();
        holder.rollback().await.unwrap();
        let outcome = running.await.unwrap().unwrap();

        assert!(
            free.is_ok(),
            "transfer {from} -> {to} holds acct-z while waiting for acct-a: {free:?}"
        );
        assert!(
            matches!(outcome.result, Ok(Reply::New(_))),
            "{from} -> {to}: {outcome:?}"
        );
    }
    assert_eq!((fx.balance("acct-a").await, fx.balance("acct-z").await), (1_000, 1_000));
}

/// One transfer in a transaction that keeps its locks 2 ms after the function returns, so
/// that concurrent transfers queue on both account rows.
async fn held_transfer(
    conn: &mut PgConnection,
    tenant: TenantId,
    effect: &Transfer,
) -> Result<Outcome<oncepay::ledger::TransferRow>, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let outcome = effect
        .run(&mut tx, tenant, &args(effect, "/transfers", &new_key()))
        .await?;
    sqlx::query("SELECT pg_sleep(0.002)").execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(outcome)
}

/// Opposite transfers between the same two accounts on four connections at once, each
/// holding its locks a little while: none deadlocks (40P01), each is applied once, the sum
/// of balances is unchanged. (A copy of the function locking `from` then `to` deadlocked 10
/// times in one run of this test.)
#[tokio::test]
async fn opposite_transfers_in_parallel_never_deadlock() {
    let fx = Fx::new().await;
    fx.open("p", 100_000).await;
    fx.open("q", 100_000).await;
    const PER_CONNECTION: usize = 100;

    // Connection i sends its n-th transfer (p -> q for even i, q -> p for odd i) of this amount.
    let amount_of = |i: i64, n: i64| 1 + i + 10 * n;

    let runs = (0..4).map(|i| {
        let (pool, tenant) = (fx.pool.clone(), fx.tenant);
        async move {
            let mut conn = pool.acquire().await.unwrap();
            let (from, to) = if i % 2 == 0 { ("p", "q") } else { ("q", "p") };
            let mut errors = Vec::new();
            for n in 0..PER_CONNECTION as i64 {
                let effect = transfer(from, to, amount_of(i, n));
                match held_transfer(&mut conn, tenant, &effect).await {
                    Ok(Outcome {
                        result: Ok(Reply::New(_)),
                        ..
                    }) => {}
                    Ok(other) => errors.push(format!("{other:?}")),
                    Err(err) => errors.push(format!("{:?}: {err}", sqlstate(&err))),
                }
            }
            errors
        }
    });
    let errors: Vec<String> = join_all(runs).await.into_iter().flatten().collect();

    assert!(errors.is_empty(), "{} failed, e.g. {:?}", errors.len(), errors.first());
    assert_eq!(fx.count("transfers").await, 4 * PER_CONNECTION as i64);
    let into_p: i64 = (0..4)
        .flat_map(|i| (0..PER_CONNECTION as i64).map(move |n| (i, n)))
        .map(|(i, n)| if i % 2 == 0 { -amount_of(i, n) } else { amount_of(i, n) })
        .sum();
    assert_eq!(fx.balance("p").await, 100_000 + into_p, "p: each transfer applied once");
    assert_eq!(
        fx.balance("p").await + fx.balance("q").await,
        200_000,
        "no money made or lost"
    );
}

/// The SQL function itself, given one account as both sides (Rust's `Transfer::new` refuses
/// it before): it refuses too, before claiming the key, and moves nothing.
#[tokio::test]
async fn transfer_from_an_account_to_itself_is_refused_in_sql() {
    let fx = Fx::new().await;
    let before = fx.snapshot().await;
    let key = new_key();
    let args = claim_args(Operation::Transfer, "/transfers", &client_claim(&key, fp("self")), WAIT);

    let refused = sqlx::query("SELECT * FROM oncepay_transfer($1, $2, 'main', 'main', 1)")
        .bind(fx.tenant.get())
        .bind(&args)
        .execute(&fx.pool)
        .await
        .unwrap_err();

    assert_eq!(sqlstate(&refused).as_deref(), Some("23514"), "{refused}");
    assert_eq!(fx.snapshot().await, before, "no key claimed, nothing moved");
}
