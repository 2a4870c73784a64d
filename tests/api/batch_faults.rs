//! What a batch of payments answers when it fails after PostgreSQL may have committed it,
//! and when the node it reached cannot write (src/batch.rs, src/db/error.rs).
//!
//! Each test runs on a database of its own, where `oncepay_pay` (a payment alone) and
//! `oncepay_pay_in_batch` (each item of a batch, migrations/V20) are wrapped by a function that
//! misbehaves *after* the real one ran, for a few magic amounts: its row does not decode, it
//! answers one row too many, it answers a combination no real call gives, it sleeps (so that
//! the test can cut the connection while the statement runs), or it raises the error a node
//! in recovery raises. The batch's statement has committed by then (autocommit with
//! `ONCEPAY_DB_POOLER=none`; one simple-protocol message, an implicit transaction, through a
//! transaction-mode pooler); the promise is that nothing is run again and nothing is said that is
//! not known: every payment answers 503, none says it was replayed, each is charged once,
//! and a retry with its key replays it.

use std::time::Duration;

use futures_util::future::join_all;
use oncepay::config::Pooler;
use oncepay::domain::MissingKeyPolicy;
use serde_json::json;
use sqlx::{Connection, PgConnection, PgPool};

use crate::batch::{hold_slot, hold_slot_at, pay_on};
use crate::support::helpers::{
    drop_database, empty_database, metric_value, new_key, new_tenant, server_url, Answer, TestApp, MAIN_BALANCE,
};
use crate::support::tcp_relay::TcpRelay;

/// Magic amounts of the wrapped `oncepay_pay` and `oncepay_pay_in_batch`.
const UNDECODABLE: i64 = 13;
const ROW_TOO_MANY: i64 = 14;
const IMPOSSIBLE: i64 = 15;
const SLOW: i64 = 16;
const IN_RECOVERY: i64 = 17;

/// The wrapper of `{f}`, the function of that name renamed to `{f}_unfaulted`.
const FAULTS: &str = r#"
ALTER FUNCTION {f}(uuid, oncepay_claim_args, text, bigint) RENAME TO {f}_unfaulted;
CREATE FUNCTION {f}(p_tenant uuid, p oncepay_claim_args, p_account text, p_amount bigint)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource payments)
LANGUAGE plpgsql ROWS 1 AS $$
DECLARE
    r record;
BEGIN
    IF p_amount = 17 THEN
        RAISE EXCEPTION 'cannot assign TransactionIds during recovery' USING ERRCODE = 'XX000';
    END IF;
    SELECT * INTO r FROM {f}_unfaulted(p_tenant, p, p_account, p_amount) AS x;
    outcome := r.outcome; decline := r.decline; expires_at := r.expires_at; resource := r.resource;
    IF p_amount = 13 THEN outcome := NULL; END IF;
    IF p_amount = 14 THEN RETURN NEXT; END IF;
    IF p_amount = 15 THEN decline := 'insufficient_funds'; END IF;
    IF p_amount = 16 THEN PERFORM pg_sleep(1.5); END IF;
    RETURN NEXT;
END
$$;
"#;

/// A migrated database of the test's own with the faulty `oncepay_pay` and
/// `oncepay_pay_in_batch`; its direct URL.
async fn faulty_database(hint: &str) -> String {
    let url = empty_database(hint).await;
    oncepay::db::migrate(&url).await.unwrap();
    let mut conn = PgConnection::connect(&url).await.unwrap();
    for f in ["oncepay_pay", "oncepay_pay_in_batch"] {
        let wrapper = FAULTS.replace("{f}", f);
        sqlx::raw_sql(&wrapper).execute(&mut conn).await.unwrap();
    }
    url
}

/// One batch slot, batches of up to 32, a tenant whose keyless payments are allowed.
async fn batching_app(url: &str) -> TestApp {
    let app = TestApp::builder()
        .settings(|s| {
            s.database_url = server_url(url);
            s.db_batches_in_flight = Some(1);
            s.db_batch_max = 32;
        })
        .spawn()
        .await;
    app.set_policy("allow").await;
    app.open_account("blocker", 1_000).await;
    app
}

fn pay_keyless(app: &TestApp, amount: i64) -> impl std::future::Future<Output = Answer> {
    let (client, url, api_key) = (app.client.clone(), app.url("/payments"), app.api_key.clone());
    async move {
        Answer::from(
            client
                .post(url)
                .bearer_auth(api_key)
                .json(&json!({ "amount": amount, "account": "main" }))
                .send()
                .await
                .unwrap(),
        )
        .await
    }
}

/// Payments of `amount` on main, by the tenant: how many there are.
async fn charged(pool: &PgPool, tenant: uuid::Uuid, amount: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payments WHERE tenant_id = $1 AND account_id = 'main' AND amount = $2")
        .bind(tenant)
        .bind(amount)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_batch_whose_answer_cannot_be_read_after_it_ran_answers_503_and_runs_nothing_again() {
    let url = faulty_database("batch_unreadable").await;
    let app = batching_app(&url).await;
    let mut expected_main = MAIN_BALANCE;
    // Amounts per round, so each round's payments are told apart: a keyed one, a keyless
    // one, and the faulty item that breaks the batch's answer.
    for (round, fault) in [UNDECODABLE, ROW_TOO_MANY, IMPOSSIBLE].into_iter().enumerate() {
        let round = i64::try_from(round).unwrap();
        let (keyed, keyless) = (100 + round, 200 + round);
        let (mut lock, first) = hold_slot(&app, &new_key(), "blocker").await;
        let key = new_key();
        let queued = tokio::spawn(join_all([
            Box::pin(pay_on(&app, &key, "main", keyed))
                as std::pin::Pin<Box<dyn std::future::Future<Output = Answer> + Send>>,
            Box::pin(pay_keyless(&app, keyless)),
            Box::pin(pay_on(&app, &new_key(), "main", fault)),
        ]));
        // Every request reaches the queue well within this; the metric below shows they
        // left in one statement.
        tokio::time::sleep(Duration::from_millis(500)).await;
        sqlx::query("COMMIT").execute(&mut lock).await.unwrap();
        assert_eq!(first.await.unwrap().status, 201);
        let answers = queued.await.unwrap();

        for answer in &answers {
            answer.assert_problem(503, "temporarily_unavailable");
            assert!(
                !answer.replayed(),
                "a first answer never says replayed: {}",
                answer.body
            );
        }
        // The statement committed before its rows were read: autocommit directly, and one
        // simple-protocol message (an implicit transaction) through a transaction-mode
        // pooler. Each payment once, the keyless one included; nothing ran again.
        expected_main -= keyed + keyless + fault;
        assert_eq!(
            charged(&app.pool, app.tenant_id, keyless).await,
            1,
            "fault {fault}: keyless charged once"
        );
        assert_eq!(app.balance("main").await, expected_main, "fault {fault}");
        assert_eq!(charged(&app.pool, app.tenant_id, keyed).await, 1);

        // The client's retry with its key settles it: the stored result.
        let retry = pay_on(&app, &key, "main", keyed).await;
        assert_eq!(retry.status, 201, "{}", retry.body);
        assert!(retry.replayed(), "{}", retry.body);
        assert_eq!(
            charged(&app.pool, app.tenant_id, keyed).await,
            1,
            "fault {fault}: charged once in all"
        );
        assert_eq!(app.balance("main").await, expected_main, "fault {fault}");
    }
    let metrics = app.metrics().await;
    assert_eq!(
        metric_value(&metrics, "oncepay_db_batches_failed_total{outcome=\"unknown\"}"),
        3.0,
        "{metrics}"
    );
    assert_eq!(
        metric_value(&metrics, "oncepay_db_batches_split_total"),
        0.0,
        "{metrics}"
    );
    drop_database(&url).await;
}

/// How a batch's connection breaks while its statement runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Break {
    /// Closed (the database host's port gone, a relay reset): PostgreSQL sees it, and ends the
    /// statement within a second (`client_connection_check_interval`, `src/db/pool.rs`).
    Closed,
    /// A partition: nothing passes either way and PostgreSQL sees nothing, so the statement
    /// commits with nobody left to hear it; the server gives up at its call's deadline.
    Partition,
}

/// A batch of three payments (keyed 40, keyless 41, keyed `SLOW`) whose connection breaks
/// `how` while its statement sleeps inside PostgreSQL: every payment is answered 503, the
/// keyless one told that a second may pay twice, and the batch is never run again; a
/// replica's retry with the key finds what PostgreSQL did (committed: replayed; ended: run
/// once, now).
async fn a_batch_broken_while_it_runs(how: Break) {
    let url = faulty_database("batch_cut").await;
    let (relay, relayed) = TcpRelay::in_front_of(&url).await;
    let pool = PgPool::connect(&url).await.unwrap();
    let (tenant_id, api_key) = new_tenant(&pool, MissingKeyPolicy::Allow).await;
    sqlx::query(
        "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance) VALUES ($1, 'blocker', 1000, 1000)",
    )
    .bind(tenant_id)
    .execute(&pool)
    .await
    .unwrap();
    // The server reaches PostgreSQL through the relay only, never through a pooler here, and
    // in autocommit. A statement timeout of 2 s (the sleep takes 1.5) puts the call's
    // deadline, which ends a partition for the server, at 7 s.
    let app = TestApp::builder()
        .settings(|s| {
            s.database_url = relayed;
            s.db_pooler = Pooler::None;
            s.db_batches_in_flight = Some(1);
            s.db_batch_max = 32;
            s.statement_timeout = Duration::from_secs(2);
        })
        .with_tenant(tenant_id, api_key.clone())
        .spawn()
        .await;

    let (mut lock, first) = hold_slot_at(&app, &url, &new_key(), "blocker").await;
    let key = new_key();
    let queued = tokio::spawn(join_all([
        Box::pin(pay_on(&app, &key, "main", 40)) as std::pin::Pin<Box<dyn std::future::Future<Output = Answer> + Send>>,
        Box::pin(pay_keyless(&app, 41)),
        Box::pin(pay_on(&app, &new_key(), "main", SLOW)),
    ]));
    tokio::time::sleep(Duration::from_millis(500)).await;
    sqlx::query("COMMIT").execute(&mut lock).await.unwrap();
    let _ = first.await.unwrap();
    // Broken while the batch's statement sleeps inside PostgreSQL.
    let mut running = false;
    for _ in 0..100 {
        let sleeping: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'oncepay' AND wait_event = 'PgSleep'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if sleeping > 0 {
            running = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(running, "the batch reached its statement");
    match how {
        Break::Closed => relay.cut().await,
        Break::Partition => relay.silence(),
    }
    let answers = queued.await.unwrap();
    for answer in &answers {
        answer.assert_problem(503, "temporarily_unavailable");
        assert!(!answer.replayed(), "{}", answer.body);
    }
    // The keyed are told to retry with their key; the keyless one, which has none, that a
    // second one may pay twice (found from outside for top-ups: it did), with no Retry-After.
    assert_eq!(answers[0].header("retry-after"), Some("1"));
    assert_eq!(answers[1].body["title"], "Outcome unknown", "{}", answers[1].body);
    assert_eq!(answers[1].header("retry-after"), None, "{}", answers[1].body);
    // Wait for PostgreSQL to finish or end the statement its client left.
    for _ in 0..100 {
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'oncepay' AND state = 'active'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let count = |amount: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payments WHERE tenant_id = $1 AND amount = $2")
                .bind(tenant_id)
                .bind(amount)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    // Partitioned, the Sync that commits was sent with the statement: it committed although
    // its client was gone. Closed, PostgreSQL ended it. Either way, never run twice.
    let done = i64::from(how == Break::Partition);
    assert_eq!(
        (count(40).await, count(41).await, count(SLOW).await),
        (done, done, done)
    );

    // Another replica, straight to the database: the retry with the key replays what
    // committed, or runs what did not, once.
    let replica = TestApp::builder()
        .settings(|s| {
            s.database_url = url.clone();
            s.db_pooler = Pooler::None;
        })
        .with_tenant(tenant_id, api_key)
        .spawn()
        .await;
    let retry = pay_on(&replica, &key, "main", 40).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (201, how == Break::Partition),
        "{}",
        retry.body
    );
    assert_eq!(count(40).await, 1);
    assert_eq!(replica.balance("main").await, MAIN_BALANCE - 40 - done * (41 + SLOW));
    let metrics = app.metrics().await;
    assert_eq!(
        metric_value(&metrics, "oncepay_db_batches_failed_total{outcome=\"unknown\"}"),
        1.0,
        "{metrics}"
    );
    pool.close().await;
    drop_database(&url).await;
}

#[tokio::test]
async fn a_batch_whose_connection_closes_while_it_runs_is_ended_by_postgresql_and_not_run_again() {
    a_batch_broken_while_it_runs(Break::Closed).await;
}

#[tokio::test]
async fn a_batch_partitioned_while_it_runs_commits_unheard_and_is_not_run_again() {
    a_batch_broken_while_it_runs(Break::Partition).await;
}

#[tokio::test]
async fn a_node_in_recovery_answers_503_alone_and_in_a_batch_and_its_connection_is_dropped() {
    let url = faulty_database("batch_recovery").await;
    let app = batching_app(&url).await;
    let closed = |metrics: &str| metric_value(metrics, "oncepay_db_connections_closed_total{reason=\"broken\"}");
    let before = closed(&app.metrics().await);

    // Alone.
    pay_on(&app, &new_key(), "main", IN_RECOVERY)
        .await
        .assert_problem(503, "temporarily_unavailable");
    // In a batch with a good payment: PostgreSQL refused the statement for the node's state,
    // not for an item, so the batch is not split (the good payment would only hit the same
    // node again): both answer 503 and nothing is charged.
    let (mut lock, first) = hold_slot(&app, &new_key(), "blocker").await;
    let good = new_key();
    let queued = tokio::spawn(join_all([
        pay_on(&app, &good, "main", 50),
        pay_on(&app, &new_key(), "main", IN_RECOVERY),
    ]));
    tokio::time::sleep(Duration::from_millis(500)).await;
    sqlx::query("COMMIT").execute(&mut lock).await.unwrap();
    assert_eq!(first.await.unwrap().status, 201);
    for answer in queued.await.unwrap() {
        answer.assert_problem(503, "temporarily_unavailable");
    }
    assert_eq!(app.balance("main").await, MAIN_BALANCE, "nothing charged");
    let retry = pay_on(&app, &good, "main", 50).await;
    assert_eq!((retry.status, retry.replayed()), (201, false), "{}", retry.body);

    let metrics = app.metrics().await;
    assert!(
        closed(&metrics) >= before + 2.0,
        "each connection that reached the node was closed, not reused:\n{metrics}"
    );
    assert_eq!(metric_value(&metrics, "oncepay_db_batches_split_total"), 0.0);
    drop_database(&url).await;
}
