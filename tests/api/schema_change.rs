//! Zero-downtime schema changes (docs/operations.md, "Changing the schema"): the "expand" step
//! of a rollout, a nullable column added to every table, is taken by replicas of the running
//! version without an error, while they serve and afterwards: every operation, alone and
//! batched, new and replayed, and every read, answers as before.
//!
//! What makes it hold: the SQL functions answer whole-row composites, which sqlx decodes
//! field by field from the start (a trailing field it does not know is left unread), and
//! PostgreSQL re-plans the functions' statements when a table changes.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use sqlx::PgPool;

use crate::batch::{hold_slot, pay_on};
use crate::support::helpers::{drop_database, new_key, spawn_app_on_own_database, Answer, TestApp, MAIN_BALANCE};

/// Every table of the service (not refinery's history).
async fn tables(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables
          WHERE table_schema = 'public' AND table_type = 'BASE TABLE' AND table_name NOT LIKE 'refinery%'
          ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Every kind of call once, each checked: a payment and its replay, a deposit, a transfer
/// and its replay, a refund, the reads. Returns the balance `main` should have moved by.
async fn every_operation(app: &TestApp) -> i64 {
    let key = new_key();
    let paid = app.pay(Some(&key), 7).await;
    assert_eq!(paid.status, 201, "{}", paid.body);
    let again = app.pay(Some(&key), 7).await;
    assert_eq!((again.status, again.replayed(), &again.body), (201, true, &paid.body));
    let id = paid.body["id"].as_str().unwrap().to_owned();
    let read = app.get(&format!("/payments/{id}")).await;
    assert_eq!(
        (read.status, read.body["amount"].as_i64()),
        (200, Some(7)),
        "{}",
        read.body
    );
    let refunded = app.refund(Some(&new_key()), &id).await;
    assert_eq!(refunded.status, 200, "{}", refunded.body);

    let deposited = app.deposit(Some(&new_key()), "side", 30).await;
    assert_eq!(deposited.status, 201, "{}", deposited.body);
    let key = new_key();
    let moved = app.transfer(Some(&key), "main", "side", 11).await;
    assert_eq!(moved.status, 201, "{}", moved.body);
    let again = app.transfer(Some(&key), "main", "side", 11).await;
    assert_eq!((again.status, again.replayed(), &again.body), (201, true, &moved.body));
    let location = moved.header("location").unwrap().to_owned();
    assert_eq!(app.get(&location).await.status, 200);
    let account = app.get("/accounts/side").await;
    assert_eq!(account.status, 200, "{}", account.body);
    11
}

#[tokio::test]
async fn a_column_added_to_every_table_while_replicas_serve_changes_no_answer() {
    let (app, url) = spawn_app_on_own_database("schema_change").await;
    let replica = TestApp::builder()
        .settings(|s| {
            s.database_url = app.state.settings.database_url.clone();
            s.db_batches_in_flight = Some(1);
        })
        .tenant_of(&app)
        .spawn()
        .await;
    app.open_account("side", 0).await;
    app.open_account("blocker", 100).await;
    // Warm every statement and function plan on both replicas.
    let mut moved = every_operation(&app).await + every_operation(&replica).await;

    // Payments flow on both replicas while the columns are added.
    let deadline = Instant::now() + Duration::from_secs(20);
    let load: Vec<_> = [app.clone(), replica.clone()]
        .into_iter()
        .flat_map(|a| (0..4).map(move |_| a.clone()))
        .map(|a| {
            tokio::spawn(async move {
                let mut answers = Vec::new();
                for _ in 0..40 {
                    if Instant::now() > deadline {
                        break;
                    }
                    answers.push(a.pay(Some(&new_key()), 1).await);
                }
                answers
            })
        })
        .collect();
    let tables = tables(&app.pool).await;
    assert!(tables.len() >= 6, "{tables:?}");
    for table in &tables {
        sqlx::query(&format!("ALTER TABLE {table} ADD COLUMN expanded_note text"))
            .execute(&app.pool)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let answers: Vec<Answer> = join_all(load).await.into_iter().flat_map(Result::unwrap).collect();
    assert!(!answers.is_empty());
    for answer in &answers {
        assert_eq!(answer.status, 201, "during the change: {}", answer.body);
    }
    let during = i64::try_from(answers.len()).unwrap();

    // After it: every operation on both replicas, and a batch.
    moved += every_operation(&app).await + every_operation(&replica).await;
    let (mut lock, first) = hold_slot(&replica, &new_key(), "blocker").await;
    let keys = [new_key(), new_key()];
    let queued = tokio::spawn(join_all([
        pay_on(&replica, &keys[0], "main", 3),
        pay_on(&replica, &keys[1], "main", 4),
    ]));
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query("COMMIT").execute(&mut lock).await.unwrap();
    assert_eq!(first.await.unwrap().status, 201);
    for (answer, key) in queued.await.unwrap().iter().zip(&keys) {
        assert_eq!(answer.status, 201, "{}", answer.body);
        let replay = pay_on(&app, key, "main", answer.body["charged"].as_i64().unwrap()).await;
        assert_eq!(
            (replay.status, replay.replayed(), &replay.body),
            (201, true, &answer.body)
        );
    }
    assert_eq!(app.balance("main").await, MAIN_BALANCE - moved - during - 7);
    let unexpected: i64 = sqlx::query_scalar("SELECT count(*) FROM payments WHERE expanded_note IS NOT NULL")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(unexpected, 0);
    drop_database(&url).await;
}
