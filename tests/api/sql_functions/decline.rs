//! `oncepay_decline` called directly: the status and code it stores, and a keyless decline.

use oncepay::ledger::ClaimArgs;
use oncepay::operation::{ClaimOutcome, Decline, Operation};

use super::{assert_wrote_nothing, claim_args, client_claim, fp, Claimed, Fx, WAIT};
use crate::support::helpers::new_key;

/// The status comes from the caller's `decline_statuses` (here deliberately not the
/// operation table's), the code is the decline, the resource is cleared.
#[tokio::test]
async fn decline_stores_the_status_from_decline_statuses_and_the_code_and_nulls_the_resource() {
    let fx = Fx::new().await;
    let key = new_key();
    let args = "ROW($2, false, $3, 'pay', 'POST', '/payments', 3600, 1000, 201,
                   '{\"insufficient_funds\": 422, \"account_not_found\": 410}')::oncepay_claim_args";
    let claimed: Claimed = sqlx::query_as(&format!(
        "SELECT outcome, decline, resource_id, expires_at FROM oncepay_claim($1, {args}, 'resource-1')"
    ))
    .bind(fx.tenant.get())
    .bind(&key)
    .bind(fp("a").to_vec())
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    assert_eq!(claimed.resource_id.as_deref(), Some("resource-1"));

    let declined: Claimed = sqlx::query_as(&format!(
        "SELECT outcome, decline, resource_id, expires_at FROM oncepay_decline($1, {args}, 'account_not_found')"
    ))
    .bind(fx.tenant.get())
    .bind(&key)
    .bind(fp("a").to_vec())
    .fetch_one(&fx.pool)
    .await
    .unwrap();

    let row = fx.key_row(&key).await.unwrap();
    assert_eq!(
        declined,
        Claimed {
            outcome: ClaimOutcome::Declined,
            decline: Some(Decline::AccountNotFound),
            resource_id: None,
            expires_at: Some(row.expires_at),
        }
    );
    assert_eq!(row.status, 410, "the status of the map given, not a literal");
    assert_eq!(row.error_code, Some(Decline::AccountNotFound));
    assert_eq!(row.resource_id, None);
}

#[tokio::test]
async fn decline_of_every_operation_stores_the_status_of_its_table_entry() {
    let fx = Fx::new().await;
    for op in Operation::ALL {
        for &decline in op.spec().declines {
            let key = new_key();
            let args = claim_args(op, op.spec().path, &client_claim(&key, fp("a")), WAIT);
            fx.claim(&args, "resource").await.unwrap();

            let declined = fx.decline(&args, decline).await;

            let row = fx.key_row(&key).await.unwrap();
            assert_eq!(
                (declined.outcome, declined.decline),
                (ClaimOutcome::Declined, Some(decline))
            );
            assert_eq!(
                (row.status, row.error_code, row.resource_id),
                (decline.status() as i16, Some(decline), None),
                "{op:?} {decline:?}"
            );
        }
    }
}

#[tokio::test]
async fn decline_without_a_key_answers_declined_and_writes_nothing() {
    let fx = Fx::new().await;
    let args = ClaimArgs::new(Operation::Pay.spec(), "/payments".to_owned(), None, WAIT);
    let mut tx = fx.pool.begin().await.unwrap();

    let declined: Claimed =
        sqlx::query_as("SELECT outcome, decline, resource_id, expires_at FROM oncepay_decline($1, $2, $3)")
            .bind(fx.tenant.get())
            .bind(&args)
            .bind(Decline::InsufficientFunds)
            .fetch_one(&mut *tx)
            .await
            .unwrap();

    assert_wrote_nothing(&mut tx).await;
    tx.commit().await.unwrap();
    assert_eq!(
        declined,
        Claimed {
            outcome: ClaimOutcome::Declined,
            decline: Some(Decline::InsufficientFunds),
            resource_id: None,
            expires_at: None,
        }
    );
}
