//! The retry schedule's steps (docs/webhooks.md, retries): each attempt's failure earns the
//! next wait of the schedule, and the schedule's end gives the message up; an attempt lost
//! with its process (its lease ran out, nothing recorded) uses up no step.

use super::planner::{insert_deliveries, planner_database, tenant_with_endpoint};
use crate::support::helpers::drop_database;

/// One claim of up to ten due deliveries: (attempt, schedule step) of each.
async fn claim(conn: &mut sqlx::PgConnection) -> Vec<(i32, i32)> {
    sqlx::query_as(
        "SELECT attempt, schedule_attempt
           FROM oncepay_webhook_claim_scheduled(10, 4, 30000, false, '{}', '{}', 10, '{}', '{}', '{}', '{}')",
    )
    .fetch_all(conn)
    .await
    .unwrap()
}

#[tokio::test]
async fn an_attempt_lost_with_its_process_is_sent_again_at_the_same_step_of_the_schedule() {
    // Found from outside: replicas killed while their attempts were out (never recorded) had
    // each lost attempt count as a step, and the resend after the lease skipped that step's
    // wait: messages were given up 13 to 33 minutes after their first attempt where the
    // schedule allowed no give-up before 43.
    let (url, mut conn) = planner_database("lost_attempt").await;
    let (tenant, endpoint) = tenant_with_endpoint(&mut conn).await;
    insert_deliveries(&mut conn, (tenant, endpoint), 1, "pending", 0).await;
    let lease_runs_out = "UPDATE webhook_deliveries
                             SET leased_until = now() - interval '1 second',
                                 next_attempt_at = now() - interval '1 second'
                           WHERE tenant_id = $1 AND leased_until IS NOT NULL";

    assert_eq!(claim(&mut conn).await, [(1, 1)], "the first attempt, the first step");
    // Its process is killed: nothing recorded; its lease runs out.
    sqlx::query(lease_runs_out)
        .bind(tenant)
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        claim(&mut conn).await,
        [(2, 1)],
        "sent again as a new attempt at the lost one's step"
    );
    // This one fails and is recorded, due again at once: the next is the schedule's second step.
    let event: uuid::Uuid = sqlx::query_scalar("SELECT event_id FROM webhook_deliveries WHERE tenant_id = $1")
        .bind(tenant)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let applied: bool = sqlx::query_scalar(
        "SELECT oncepay_webhook_record($1, $2, $3, 2, now(), 15000, NULL, NULL, 'no answer within 15000 ms',
                                                     'test', 'retry', now() - interval '1 second')",
    )
    .bind(tenant)
    .bind(event)
    .bind(endpoint)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert!(applied, "the record of the attempt out is applied");
    assert_eq!(claim(&mut conn).await, [(3, 2)], "the next attempt, the next step");

    // A recovery restarts the schedule under the attempt out (V33: schedule_start = its
    // number, step 0); lost with its process, it is sent again at the new schedule's first step.
    sqlx::query("UPDATE webhook_deliveries SET schedule_start = attempts WHERE tenant_id = $1")
        .bind(tenant)
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query(lease_runs_out)
        .bind(tenant)
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(claim(&mut conn).await, [(4, 1)], "the restarted schedule's first step");
    drop(conn);
    drop_database(&url).await;
}
