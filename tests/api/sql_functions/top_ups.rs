//! The top-ups' phases of migrations/V23, called directly: every write after the first checks
//! the lease's owner (a driver whose lease was taken writes nothing, whatever it calls), the
//! key series move once, and the completer claims one due top-up of its processors.

use uuid::Uuid;

use super::Fx;
use crate::support::helpers::MAIN_BALANCE;

const AMOUNT: i64 = 700;

/// A top-up of `main` in the state `columns` give (on top of a processing one whose
/// PaymentIntent `pi_owned` is committed), leased to `owner`.
async fn top_up(fx: &Fx, owner: Uuid, columns: &str) -> Uuid {
    let id = Uuid::new_v4();
    sqlx::query(&format!(
        "INSERT INTO top_ups (tenant_id, top_up_id, account_id, amount, currency, payment_method, status,
                              recovery_point, processor_payment_id, lease_owner, lease_expires_at,
                              created_at, updated_at, processor)
         VALUES ($1, $2, 'main', {AMOUNT}, 'usd', 'pm_card_visa', 'processing', 'intent_created',
                 'pi_owned', $3, now() + interval '1 minute', now(), now(), 'test-processor')"
    ))
    .bind(fx.tenant.get())
    .bind(id)
    .bind(owner)
    .execute(&fx.pool)
    .await
    .unwrap();
    if !columns.is_empty() {
        sqlx::query(&format!(
            "UPDATE top_ups SET {columns} WHERE tenant_id = $1 AND top_up_id = $2"
        ))
        .bind(fx.tenant.get())
        .bind(id)
        .execute(&fx.pool)
        .await
        .unwrap();
    }
    id
}

/// The row's columns named, as text.
async fn row(fx: &Fx, id: Uuid, columns: &str) -> String {
    sqlx::query_scalar(&format!(
        "SELECT concat_ws(' ', {columns}) FROM top_ups WHERE tenant_id = $1 AND top_up_id = $2"
    ))
    .bind(fx.tenant.get())
    .bind(id)
    .fetch_one(&fx.pool)
    .await
    .unwrap()
}

async fn call(fx: &Fx, sql: &str, id: Uuid, owner: Uuid) {
    sqlx::query(sql)
        .bind(fx.tenant.get())
        .bind(id)
        .bind(owner)
        .execute(&fx.pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_final_phase_of_another_owner_changes_nothing() {
    let fx = Fx::new().await;
    let (owner, stranger) = (Uuid::new_v4(), Uuid::new_v4());
    let succeed = "SELECT oncepay_top_up_succeed($1, $2, $3, 'pi_owned')";
    let fail = "SELECT oncepay_top_up_fail($1, $2, $3, 'card_declined', 'card_declined', 402::smallint, \
                'generic_decline', 'requires_payment_method')";
    let wait = "SELECT oncepay_top_up_wait($1, $2, $3, 'processing', 60)";

    let id = top_up(&fx, owner, "").await;
    for sql in [succeed, fail, wait] {
        call(&fx, sql, id, stranger).await;
        assert_eq!(
            row(&fx, id, "status, processor_status, checks").await,
            "processing 0",
            "{sql}"
        );
    }
    assert_eq!(fx.balance("main").await, MAIN_BALANCE, "no credit for another owner");
    call(&fx, succeed, id, owner).await;
    assert_eq!(row(&fx, id, "status, lease_owner").await, "succeeded");
    assert_eq!(fx.balance("main").await, MAIN_BALANCE + AMOUNT);
    call(&fx, succeed, id, owner).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE + AMOUNT, "credited once");

    let id = top_up(&fx, owner, "").await;
    call(&fx, fail, id, owner).await;
    assert_eq!(
        row(&fx, id, "status, failure_code, decline_code, processor_status").await,
        "failed card_declined generic_decline requires_payment_method"
    );

    let id = top_up(&fx, owner, "").await;
    call(&fx, wait, id, owner).await;
    assert_eq!(
        row(
            &fx,
            id,
            "status, processor_status, checks, next_check_at > now(), lease_expires_at <= now()"
        )
        .await,
        "processing processing 1 t t",
        "recorded, the lease given back"
    );
}

#[tokio::test]
async fn a_refunds_end_of_another_owner_changes_nothing_and_a_failure_credits_back_once() {
    let fx = Fx::new().await;
    let (owner, stranger) = (Uuid::new_v4(), Uuid::new_v4());
    // Succeeded (credited), then debited for a refund: the balance is the same as before both.
    let debited = format!(
        "status = 'succeeded', recovery_point = 'finished', balance_after = {MAIN_BALANCE}, \
         refund_state = 'debited', balance_after_refund = {MAIN_BALANCE}, refund_requested_at = now()"
    );
    let refunded = "SELECT oncepay_top_up_refunded($1, $2, $3, 're_1')";
    let failed =
        "SELECT oncepay_top_up_refund_failed($1, $2, $3, 're_1', 'failed', 'lost_or_stolen_card', 402::smallint)";
    let id = top_up(&fx, owner, &debited).await;
    for sql in [refunded, failed] {
        call(&fx, sql, id, stranger).await;
        assert_eq!(row(&fx, id, "status, refund_state").await, "succeeded debited", "{sql}");
    }
    call(&fx, failed, id, owner).await;
    assert_eq!(
        row(
            &fx,
            id,
            "status, refund_state IS NULL, refund_status, refund_failure_code"
        )
        .await,
        "succeeded t failed lost_or_stolen_card"
    );
    assert_eq!(fx.balance("main").await, MAIN_BALANCE + AMOUNT, "credited back");
    call(&fx, failed, id, owner).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE + AMOUNT, "once");

    let id = top_up(&fx, owner, &debited).await;
    call(&fx, refunded, id, owner).await;
    assert_eq!(
        row(&fx, id, "status, refund_state, refund_status").await,
        "refunded refunded succeeded"
    );

    // The previous version's call takes no refund this version saw pending.
    let id = top_up(&fx, owner, &format!("{debited}, refund_status = 'pending'")).await;
    sqlx::query("SELECT oncepay_top_up_refunded($1, $2, 're_1')")
        .bind(fx.tenant.get())
        .bind(id)
        .execute(&fx.pool)
        .await
        .unwrap();
    assert_eq!(row(&fx, id, "status, refund_state").await, "succeeded debited");
}

#[tokio::test]
async fn a_key_series_moves_once_from_where_its_driver_saw_it() {
    let fx = Fx::new().await;
    let (owner, stranger) = (Uuid::new_v4(), Uuid::new_v4());
    let id = top_up(&fx, owner, "").await;
    let next = |from: i32| format!("SELECT oncepay_top_up_next_key($1, $2, $3, 'confirm', {from}, 30)");
    call(&fx, &next(0), id, stranger).await;
    call(&fx, &next(1), id, owner).await;
    assert_eq!(
        row(&fx, id, "confirm_key_series").await,
        "0",
        "another owner, another start: nothing"
    );
    call(&fx, &next(0), id, owner).await;
    call(&fx, &next(0), id, owner).await;
    assert_eq!(row(&fx, id, "confirm_key_series, create_key_series").await, "1 0");
    let renew = "SELECT oncepay_top_up_renew($1, $2, $3, 30)";
    call(&fx, renew, id, stranger).await;
    assert_eq!(row(&fx, id, "lease_owner").await, owner.to_string());
    let unknown = sqlx::query("SELECT oncepay_top_up_next_key($1, $2, $3, 'refund_all', 0, 30)")
        .bind(fx.tenant.get())
        .bind(id)
        .bind(owner)
        .execute(&fx.pool)
        .await;
    assert!(unknown.is_err(), "a call without a series is refused");
}

#[tokio::test]
async fn the_completer_claims_due_top_ups_of_its_processors_only() {
    let fx = Fx::new().await;
    let nobody = Uuid::new_v4();
    // A processor of this test's own: the claim is not scoped to a tenant.
    let processor = format!("test-{}", fx.tenant.get());
    let free = format!("lease_owner = NULL, lease_expires_at = NULL, processor = '{processor}'");
    let stale = top_up(&fx, nobody, &format!("{free}, updated_at = now() - interval '1 hour'")).await;
    let not_yet = top_up(
        &fx,
        nobody,
        &format!("{free}, updated_at = now() - interval '1 hour', next_check_at = now() + interval '1 hour'"),
    )
    .await;
    let elsewhere = top_up(
        &fx,
        nobody,
        "lease_owner = NULL, lease_expires_at = NULL, updated_at = now() - interval '1 hour', processor = 'another'",
    )
    .await;
    let completer = Uuid::new_v4();
    let claim = || {
        sqlx::query_scalar::<_, Uuid>(
            "SELECT top_up_id FROM oncepay_top_up_claim_due($1, 30, 30, 1, ARRAY[$2, 'a-name-of-before'])",
        )
        .bind(completer)
        .bind(&processor)
        .fetch_all(&fx.pool)
    };
    assert_eq!(claim().await.unwrap(), [stale]);
    assert!(
        claim().await.unwrap().is_empty(),
        "leased now; the others not due or elsewhere"
    );
    assert_eq!(row(&fx, not_yet, "lease_owner IS NULL").await, "t");
    assert_eq!(row(&fx, elsewhere, "lease_owner IS NULL").await, "t");
}
