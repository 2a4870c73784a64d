//! The outbox: an event commits with its change or not at all; a late commit is not
//! skipped; events written while nothing delivers are fanned out in order; a batch writes one
//! event per new payment; a payment's event is rendered when read; events go with the purge
//! after their retention.

use std::time::Duration;

use reqwest::Method;
use uuid::Uuid;

use oncepay::domain::MissingKeyPolicy;

use super::{
    all_delivered, committed, delivering, delivering_app, endpoints_stored, pay, refund, subscribe, wait_until, WAIT,
};
use crate::support::helpers::{drop_database, new_key, TestApp};
use crate::support::webhook_receiver::Receiver;

/// The trap of outbox readers that page by a sequence: an event whose transaction commits
/// after later ones is not skipped. Here a payment's transaction stays open while later
/// payments commit and are delivered; it then commits, and its event is delivered too.
#[tokio::test]
async fn an_event_committed_late_is_not_skipped() {
    let app = delivering_app().await;
    let receiver = Receiver::start().await;
    subscribe(&app, &receiver, None).await;
    // Its own account: the open transaction holds that row's lock, not main's.
    app.open_account("late", 100).await;
    let mut tx = app.pool.begin().await.unwrap();
    let late: Uuid = sqlx::query_scalar(
        "SELECT (resource).payment_id FROM oncepay_pay($1, ROW(NULL, false, NULL, 'pay', 'POST', '/payments', 0, 1000, 201, '{}')::oncepay_claim_args, 'late', 7)",
    )
    .bind(app.tenant_id)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    for _ in 0..5 {
        pay(&app, 10).await;
    }
    receiver.wait_for_acknowledged(5, WAIT).await;
    tx.commit().await.unwrap();
    let report = all_delivered(&app, &receiver).await;
    assert_eq!(report.events, 6);
    assert!(receiver.messages().iter().any(|m| m.resource == late.to_string()));
}

/// While no replica delivers, a change's transaction writes its event alone (migrations/V14).
/// The first deliverer to claim fans the backlog out in event order (each payment's success
/// before its refund) to the endpoints registered before the change, none after; an event
/// that no endpoint takes by then (its one endpoint deleted meanwhile) stays readable and goes
/// with the purge after the retention.
#[tokio::test]
async fn events_written_while_none_delivers_are_fanned_out_in_order_to_the_endpoints_registered_before_them() {
    let (quiet, url) = crate::support::helpers::spawn_app_on_own_database("fan_out").await;
    let gone = Receiver::start().await;
    let gone_endpoint = subscribe(&quiet, &gone, None).await;
    let unsent = quiet.deposit(Some(&new_key()), "main", 5).await;
    assert_eq!(unsent.status, 201, "{}", unsent.body);
    let unsent = unsent.body["id"].as_str().unwrap().to_owned();
    let deleted = quiet
        .client
        .delete(quiet.url(&format!("/webhook-endpoints/{gone_endpoint}")));
    assert_eq!(deleted.bearer_auth(&quiet.api_key).send().await.unwrap().status(), 204);
    let receiver = Receiver::start().await;
    subscribe(&quiet, &receiver, None).await;
    for _ in 0..5 {
        let payment = pay(&quiet, 10).await;
        refund(&quiet, &payment).await;
    }
    let late = Receiver::start().await;
    subscribe(&quiet, &late, None).await;
    let counts = || async {
        let r: (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM webhook_events WHERE awaiting_fan_out),
                    (SELECT count(*) FROM webhook_deliveries)",
        )
        .fetch_one(&quiet.pool)
        .await
        .unwrap();
        r
    };
    assert_eq!(
        counts().await,
        (11, 0),
        "events awaiting their fan-out, no delivery written"
    );

    let _deliverer = TestApp::builder()
        .settings(|s| {
            s.database_url = crate::support::helpers::server_url(&url);
            delivering(s);
        })
        .tenant_of(&quiet)
        .spawn()
        .await;
    let mut expected = committed(&quiet).await;
    assert!(expected.remove(&unsent).is_some());
    receiver.wait_for_acknowledged(10, WAIT).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = receiver.check(&expected);
    assert_eq!(report.events, 10, "{report:?}");
    assert!(gone.messages().is_empty(), "the deleted endpoint got an event");
    assert!(
        late.messages().is_empty(),
        "an endpoint got the changes made before it was registered"
    );
    assert_eq!(counts().await.0, 0, "every event fanned out");

    let (unsent_event, awaiting): (Uuid, Option<bool>) =
        sqlx::query_as("SELECT event_id, awaiting_fan_out FROM webhook_events WHERE resource_id = $1")
            .bind(&unsent)
            .fetch_one(&quiet.pool)
            .await
            .unwrap();
    assert_eq!(awaiting, Some(false), "fanned out to no endpoint");
    assert_eq!(quiet.get(&format!("/events/{unsent_event}")).await.status, 200);
    sqlx::query("UPDATE webhook_events SET created_at = now() - interval '30 days' WHERE event_id = $1")
        .bind(unsent_event)
        .execute(&quiet.pool)
        .await
        .unwrap();
    assert_eq!(quiet.admin(Method::POST, "/admin/purge", None).await.status, 200);
    quiet
        .get(&format!("/events/{unsent_event}"))
        .await
        .assert_problem(404, "not_found");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_events")
        .fetch_one(&quiet.pool)
        .await
        .unwrap();
    assert_eq!(left, 10, "the delivered events stay for their retention");
    drop_database(&url).await;
}

/// Events are kept `ONCEPAY_EVENT_RETENTION_DAYS` (30) from their creation, delivered or not
/// (docs/webhooks.md), then purged with their deliveries and attempts: one delivered long
/// ago but created within the retention stays (before V24 it went a key retention after its
/// delivery), one created before goes even with a delivery still pending.
/// Makes the events of `resource` (and their deliveries) 31 days old: past the default event
/// retention.
async fn age_past_retention(app: &TestApp, resource: &str) {
    sqlx::query(
        "WITH e AS (UPDATE webhook_events SET created_at = now() - interval '31 days'
                     WHERE tenant_id = $1 AND resource_id = $2 RETURNING event_id)
         UPDATE webhook_deliveries d SET created_at = now() - interval '31 days'
           FROM e WHERE d.tenant_id = $1 AND d.event_id = e.event_id",
    )
    .bind(app.tenant_id)
    .bind(resource)
    .execute(&app.pool)
    .await
    .unwrap();
}

/// Found by a full test run: an attempt out while the purge deleted its event was recorded
/// afterwards, an attempt row without its event that no purge would ever reach (the test
/// below counted it). The record writes attempts only of events still there (V33).
#[tokio::test]
async fn an_attempt_out_while_the_purge_deletes_its_event_leaves_no_attempt_behind() {
    let app = delivering_app().await;
    let receiver = Receiver::start().await;
    receiver.set_delay(Duration::from_secs(2));
    subscribe(&app, &receiver, None).await;
    let payment = pay(&app, 10).await;
    wait_until("the attempt out", WAIT, || async { receiver.in_flight() >= 1 }).await;
    age_past_retention(&app, &payment).await;
    let purged = app.admin(Method::POST, "/admin/purge", None).await;
    assert_eq!(purged.status, 200);
    assert_eq!(receiver.in_flight(), 1, "the purge ran while the attempt was out");

    receiver.wait_for_acknowledged(1, WAIT).await;
    // The record follows the answer within the attempt's bookkeeping; give it a moment.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let (events, attempts): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM webhook_events WHERE tenant_id = $1),
                (SELECT count(*) FROM webhook_attempts WHERE tenant_id = $1)",
    )
    .bind(app.tenant_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        (events, attempts),
        (0, 0),
        "the event purged, and no attempt of it left"
    );
}

#[tokio::test]
async fn events_are_purged_after_their_retention_delivered_or_not_with_their_deliveries() {
    let app = delivering_app().await;
    let receiver = Receiver::start().await;
    subscribe(&app, &receiver, None).await;
    let down = Receiver::unstarted().await;
    subscribe(&app, &down, None).await;
    let old = pay(&app, 10).await;
    let young = pay(&app, 10).await;
    // Each event fanned out to both endpoints: delivered to the first, pending for the second.
    all_delivered(&app, &receiver).await;
    age_past_retention(&app, &old).await;
    sqlx::query(
        "UPDATE webhook_deliveries SET finished_at = now() - interval '29 days'
          WHERE tenant_id = $1 AND resource_id = $2 AND finished_at IS NOT NULL",
    )
    .bind(app.tenant_id)
    .bind(&young)
    .execute(&app.pool)
    .await
    .unwrap();

    let purged = app.admin(Method::POST, "/admin/purge", None).await;
    assert_eq!(purged.status, 200);
    // The answer counts them (found from outside: a run that deleted 1.56 million webhook rows
    // answered only `{"deleted": 0}`, its count of key rows). Parallel tests' old events may
    // go in the same run: at least this one.
    let events_deleted = purged.body["events_deleted"]
        .as_u64()
        .unwrap_or_else(|| panic!("`events_deleted` is a count: {}", purged.body));
    assert!(events_deleted >= 1, "{}", purged.body);

    let counts = |resource: String| {
        let app = app.clone();
        async move {
            let r: (i64, i64, i64) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM webhook_events WHERE tenant_id = $1 AND resource_id = $2),
                        (SELECT count(*) FROM webhook_deliveries WHERE tenant_id = $1 AND resource_id = $2),
                        (SELECT count(*) FROM webhook_attempts a JOIN webhook_events e USING (tenant_id, event_id)
                          WHERE a.tenant_id = $1 AND e.resource_id = $2)",
            )
            .bind(app.tenant_id)
            .bind(resource)
            .fetch_one(&app.pool)
            .await
            .unwrap();
            r
        }
    };
    let (events, deliveries, _) = counts(old.clone()).await;
    assert_eq!(
        (events, deliveries),
        (0, 0),
        "the old event went with both its deliveries"
    );
    let orphans: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_attempts a WHERE tenant_id = $1
            AND NOT EXISTS (SELECT FROM webhook_events e WHERE e.tenant_id = a.tenant_id AND e.event_id = a.event_id)",
    )
    .bind(app.tenant_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(orphans, 0, "attempts go with their event");
    let (events, deliveries, attempts) = counts(young.clone()).await;
    assert_eq!(
        (events, deliveries),
        (1, 2),
        "the young event is kept, delivered or not"
    );
    assert!(attempts >= 1, "with its attempts");
    let listed = app.get("/events").await;
    assert_eq!(listed.body["data"].as_array().unwrap().len(), 1, "{}", listed.body);
}

/// A batch (src/batch.rs: `oncepay_pay_batch`, migrations/V20, the payments one call each and
/// then their events in one INSERT) writes one event per new payment of a tenant with an
/// endpoint, with the payment's id, and none for the duplicate of a key inside it (a replay),
/// for a declined item, or for a tenant of the same batch without an endpoint. A read-only
/// transaction (a database turned read-only by a failover, migrations/V21) answers the batch's
/// replays, and refuses a new key without writing anything.
#[tokio::test]
async fn a_batch_emits_one_event_per_new_payment_and_none_for_its_replays() {
    let app = TestApp::builder().spawn().await;
    let receiver = Receiver::unstarted().await;
    subscribe(&app, &receiver, None).await;
    let (quiet, _) = crate::support::helpers::new_tenant(&app.pool, MissingKeyPolicy::Reject).await;
    let keys = [new_key(), new_key(), new_key(), new_key(), new_key()];
    // The second key twice (created, then replayed), a payment on no account (declined), and a
    // payment of a tenant without an endpoint, in one batch.
    let items = [
        (app.tenant_id, &keys[0], "main"),
        (app.tenant_id, &keys[1], "main"),
        (app.tenant_id, &keys[1], "main"),
        (app.tenant_id, &keys[2], "nobody"),
        (quiet, &keys[3], "main"),
        (app.tenant_id, &keys[4], "main"),
    ];
    let answers = pay_batch(&mut app.pool.acquire().await.unwrap(), &items).await.unwrap();
    let outcomes: Vec<&str> = answers.iter().map(|a| a.0.as_str()).collect();
    assert_eq!(
        outcomes,
        ["created", "created", "replayed", "declined", "created", "created"]
    );
    let events = || async {
        sqlx::query_scalar::<_, Uuid>(
            "SELECT event_id FROM webhook_events
              WHERE tenant_id = ANY($1) AND event_type = 'payment.succeeded' AND event_id::text = resource_id
                AND data IS NULL AND awaiting_fan_out ORDER BY sequence",
        )
        .bind([app.tenant_id, quiet])
        .fetch_all(&app.pool)
        .await
        .unwrap()
    };
    let all: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_events WHERE tenant_id = ANY($1)")
        .bind([app.tenant_id, quiet])
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let hooked_payments = [answers[0].1.unwrap(), answers[1].1.unwrap(), answers[5].1.unwrap()];
    assert_eq!(
        events().await,
        hooked_payments,
        "one event per new payment of the hooked tenant, in order"
    );
    assert_eq!(all, 3, "no other event");
    // The same batch again: every item a replay (the decline's too), no event.
    let again = pay_batch(&mut app.pool.acquire().await.unwrap(), &items).await.unwrap();
    let outcomes: Vec<String> = again.into_iter().map(|a| a.0).collect();
    assert_eq!(outcomes, ["replayed"; 6]);
    assert_eq!(events().await, hooked_payments);

    // In a read-only transaction: the replays are answered (a statement that contains an
    // INSERT is refused there even when it would insert nothing, so V21 leaves it out), a new
    // key is refused (25006) and leaves no key, payment or event.
    let read_only = async |items: &[(Uuid, &String, &str)]| {
        let mut tx = app.pool.begin().await.unwrap();
        sqlx::query("SET TRANSACTION READ ONLY")
            .execute(&mut *tx)
            .await
            .unwrap();
        let answer = pay_batch(&mut tx, items).await;
        tx.rollback().await.unwrap();
        answer
    };
    let replayed = read_only(&items).await.unwrap();
    assert_eq!(
        replayed.iter().map(|a| a.0.as_str()).collect::<Vec<_>>(),
        ["replayed"; 6]
    );
    assert_eq!(replayed[5].1, answers[5].1, "the stored payment");
    let fresh = new_key();
    let refused = read_only(&[(app.tenant_id, &keys[0], "main"), (app.tenant_id, &fresh, "main")])
        .await
        .unwrap_err();
    assert_eq!(
        refused.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("25006"),
        "{refused}"
    );
    let keys_of_fresh: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key = $1")
        .bind(&fresh)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(keys_of_fresh, 0);
    assert_eq!(events().await, hooked_payments);
}

/// `oncepay_pay_batch` called as the server's batch statement calls it (src/ledger/effects.rs),
/// a payment of 5 per item: each item's outcome and payment id.
async fn pay_batch(
    conn: &mut sqlx::PgConnection,
    items: &[(Uuid, &String, &str)],
) -> Result<Vec<(String, Option<Uuid>)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT outcome::text, (resource).payment_id
           FROM oncepay_pay_batch($1::uuid[],
                    ARRAY(SELECT ROW(k, false, sha256(convert_to(k, 'UTF8')), 'pay', 'POST', '/payments', 86400,
                                     1000, 201, '{\"account_not_found\": 404}')::oncepay_claim_args
                            FROM unnest($2::text[]) WITH ORDINALITY AS u(k, n) ORDER BY n),
                    $3::text[], array_fill(5::bigint, ARRAY[cardinality($3::text[])]))
          ORDER BY item",
    )
    .bind(items.iter().map(|i| i.0).collect::<Vec<_>>())
    .bind(items.iter().map(|i| i.1.as_str()).collect::<Vec<_>>())
    .bind(items.iter().map(|i| i.2).collect::<Vec<_>>())
    .fetch_all(conn)
    .await
}

/// A payment's event is written without its data (migrations/V18), which the deliverer and
/// GET /events/{id} render from the payment row: as the payment was when it succeeded, the
/// same as the answer to its POST, even when it was refunded before the event went out.
#[tokio::test]
async fn a_payment_event_is_stored_without_data_and_delivered_as_the_payment_was_created() {
    let (writer, url) = crate::support::helpers::spawn_app_on_own_database("webhook_rendered").await;
    let receiver = Receiver::start().await;
    subscribe(&writer, &receiver, None).await;
    let paid = writer.pay(Some(&new_key()), 40).await;
    assert_eq!(paid.status, 201, "{}", paid.body);
    let payment = paid.body["id"].as_str().unwrap().to_owned();
    refund(&writer, &payment).await;
    let stored: Vec<(String, Option<serde_json::Value>)> =
        sqlx::query_as("SELECT event_type, data FROM webhook_events WHERE tenant_id = $1 ORDER BY sequence")
            .bind(writer.tenant_id)
            .fetch_all(&writer.pool)
            .await
            .unwrap();
    assert_eq!(stored.len(), 2, "{stored:?}");
    assert_eq!(stored[0], ("payment.succeeded".to_owned(), None));
    assert_eq!(stored[1].0, "payment.refunded");
    assert!(stored[1].1.is_some(), "other events keep their data");

    let _deliverer = TestApp::builder()
        .tenant_of(&writer)
        .settings(|s| {
            delivering(s);
            s.database_url = crate::support::helpers::server_url(&url);
        })
        .spawn()
        .await;
    let report = all_delivered(&writer, &receiver).await;
    assert_eq!(report.events, 2, "{report:?}");
    let messages = receiver.messages();
    let succeeded = messages.iter().find(|m| m.event_type == "payment.succeeded").unwrap();
    let data = &succeeded.body["data"];
    for key in ["id", "account", "status", "created_at"] {
        assert_eq!(
            data[key], paid.body[key],
            "{key}: the answer to the POST was {}",
            paid.body
        );
    }
    assert_eq!(data["amount"], paid.body["charged"]);
    assert_eq!(data["status"], "succeeded");
    assert_eq!(data["refunded_at"], serde_json::Value::Null);
    let keys: Vec<_> = data.as_object().unwrap().keys().cloned().collect();
    assert_eq!(keys, ["account", "amount", "created_at", "id", "refunded_at", "status"]);
    assert_eq!(succeeded.id, payment, "a payment's event takes the payment's id (V19)");
    assert_eq!(
        succeeded.body["timestamp"], paid.body["created_at"],
        "and the payment's time"
    );
    let event = writer.get(&format!("/events/{}", succeeded.id)).await;
    assert_eq!(event.status, 200, "{}", event.body);
    assert_eq!(&event.body["data"], data);
    let refunded = messages.iter().find(|m| m.event_type == "payment.refunded").unwrap();
    assert_eq!(refunded.body["data"]["status"], "refunded");
    drop(writer);
    crate::support::helpers::drop_database(&url).await;
}

/// Found from outside: a tenant that created and deleted endpoints in a loop left every
/// deleted row for ever (3,425 of 3,428 after 20 s). The purge deletes an endpoint deleted
/// past both retentions (keys 7 days, events 30 by default), once its events are gone; a
/// younger deletion stays.
#[tokio::test]
async fn an_endpoint_deleted_past_both_retentions_is_purged() {
    let app = delivering_app().await;
    let receiver = Receiver::unstarted().await;
    let mut deleted = Vec::new();
    for _ in 0..2 {
        let id = subscribe(&app, &receiver, None).await;
        let answer = app
            .client
            .delete(app.url(&format!("/webhook-endpoints/{id}")))
            .bearer_auth(&app.api_key)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 204);
        deleted.push(id);
    }
    let live = subscribe(&app, &receiver, None).await;
    for (id, age) in [(&deleted[0], "31 days"), (&deleted[1], "29 days")] {
        sqlx::query(&format!(
            "UPDATE webhook_endpoints SET deleted_at = now() - interval '{age}'
              WHERE tenant_id = $1 AND endpoint_id = $2::uuid"
        ))
        .bind(app.tenant_id)
        .bind(id)
        .execute(&app.pool)
        .await
        .unwrap();
    }
    assert_eq!(endpoints_stored(&app).await, 3);

    let purged = app.admin(Method::POST, "/admin/purge", None).await;
    assert_eq!(purged.status, 200, "{}", purged.body);
    let left: Vec<String> = sqlx::query_scalar("SELECT endpoint_id::text FROM webhook_endpoints WHERE tenant_id = $1")
        .bind(app.tenant_id)
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert!(!left.contains(&deleted[0]), "deleted 31 days ago: purged ({left:?})");
    assert!(left.contains(&deleted[1]), "deleted 29 days ago: kept");
    assert!(left.contains(&live), "not deleted: kept");
    assert_eq!(left.len(), 2);
}
