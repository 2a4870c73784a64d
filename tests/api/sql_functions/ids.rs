//! `oncepay_uuid7` (migrations/V29): the ids oncepay draws for new resources are UUIDv7s,
//! time-ordered so that a table's primary key grows at its right edge.

use chrono::Utc;
use uuid::Uuid;

use super::{claim_args, client_claim, fp, Claimed, Fx, WAIT};
use crate::support::helpers::{assert_v7_between, new_key};
use oncepay::operation::{ClaimOutcome, Operation};

/// The Unix milliseconds of a UUIDv7.
fn millis(id: Uuid) -> u64 {
    let (secs, nanos) = id.get_timestamp().expect("a v7 has a time").to_unix();
    secs * 1_000 + u64::from(nanos / 1_000_000)
}

#[tokio::test]
async fn uuid7_draws_distinct_version_7_ids_in_time_order() {
    let fx = Fx::new().await;
    let before = Utc::now().timestamp_millis();
    let ids: Vec<Uuid> =
        sqlx::query_scalar("SELECT array_agg(oncepay_uuid7() ORDER BY g) FROM generate_series(1, 10000) g")
            .fetch_one(&fx.pool)
            .await
            .unwrap();
    let after = Utc::now().timestamp_millis();

    assert_eq!(ids.len(), 10_000);
    for id in &ids {
        assert_v7_between(*id, before, after);
    }
    assert!(
        ids.windows(2).all(|w| millis(w[0]) <= millis(w[1])),
        "drawn one after another, their milliseconds never go back"
    );
    let mut distinct = ids.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), ids.len(), "no id drawn twice");
    // The random bits are the low ones: ids of the same millisecond differ there.
    let low_62 = |id: &Uuid| u128::from_be_bytes(*id.as_bytes()) & ((1u128 << 62) - 1);
    let mut lows: Vec<u128> = ids.iter().map(low_62).collect();
    lows.sort_unstable();
    lows.dedup();
    assert_eq!(lows.len(), ids.len(), "the low 62 bits are random");
}

#[tokio::test]
async fn a_claim_given_no_id_draws_a_uuid7_for_its_resource() {
    let fx = Fx::new().await;
    let args = claim_args(Operation::Pay, "/payments", &client_claim(&new_key(), fp("a")), WAIT);
    let before = Utc::now().timestamp_millis();

    let claimed: Claimed =
        sqlx::query_as("SELECT outcome, decline, resource_id, expires_at FROM oncepay_claim($1, $2, NULL)")
            .bind(fx.tenant.get())
            .bind(&args)
            .fetch_one(&fx.pool)
            .await
            .unwrap();

    let after = Utc::now().timestamp_millis();
    assert_eq!(claimed.outcome, ClaimOutcome::Created);
    let id: Uuid = claimed.resource_id.as_deref().unwrap().parse().unwrap();
    assert_v7_between(id, before, after);
}
