//! The connection pool (src/db.rs): a connection goes back to the pool without a round trip,
//! so it is checked when it comes out again after sitting idle, and one left in the middle
//! of a call is closed rather than handed to the next request.

use std::time::{Duration, Instant};

use oncepay::db::Db;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, Executor, PgConnection};

use crate::support::helpers::{
    database_url, drop_database, metric_value, new_key, spawn_app_on_own_database, spawn_app_on_own_database_with,
    through_pooler,
};

async fn backend_pid(db: &Db) -> i32 {
    db.run(async |c| sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(c).await)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_connection_cut_while_idle_is_replaced_before_a_request_uses_it() {
    let (app, url) = spawn_app_on_own_database("idlecut").await;
    let name = url.rsplit('/').next().unwrap().to_owned();
    assert_eq!(
        app.pay(Some(&new_key()), 1).await.status,
        201,
        "a first payment opens a connection"
    );

    // Cut every connection of the server while it sits in the pool (a failover, a restart).
    let mut admin = PgConnection::connect(&database_url()).await.unwrap();
    // pg_terminate_backend with a timeout returns true once the backend has exited: this
    // counts sessions ended, not merely found.
    let cut: i64 = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE ended) FROM (
           SELECT pg_terminate_backend(pid, 5000) AS ended FROM pg_stat_activity
            WHERE datname = $1 AND application_name = 'oncepay') t",
    )
    .bind(&name)
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert!(cut >= 1, "the server's pooled connection was ended");
    // Past the idle time after which a connection is pinged when it leaves the pool.
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    let answer = app.pay(Some(&new_key()), 1).await;
    assert_eq!(
        answer.status, 201,
        "the dead connection was found and replaced before use: {}",
        answer.body
    );
    // Through PgBouncer the server's own connection (to the pooler) survives the cut: there
    // is nothing to replace, only the answer above to check.
    if !through_pooler() {
        let metrics = app.metrics().await;
        assert!(
            metric_value(&metrics, r#"oncepay_db_connections_closed_total{reason="dead_idle"}"#) >= 1.0,
            "the replaced connection is counted:\n{metrics}"
        );
    }
    app.state.db.close().await;
    drop_database(&url).await;
}

/// Replicas of one database are told apart in `pg_stat_activity` by the `application_name`
/// of their `DATABASE_URL`, as any libpq client's are (found from outside: every replica's
/// sessions were named `oncepay`, whatever the URL said); without one they are `oncepay`.
#[tokio::test]
async fn the_application_name_of_database_url_names_the_servers_sessions() {
    let (named, url) = spawn_app_on_own_database_with("appname", |s| {
        s.database_url.push_str("?application_name=oncepay-replica-7");
    })
    .await;
    let unnamed = crate::support::helpers::TestApp::builder()
        .settings(|s| {
            s.database_url = named
                .state
                .settings
                .database_url
                .replace("?application_name=oncepay-replica-7", "")
        })
        .spawn()
        .await;
    for app in [&named, &unnamed] {
        assert_eq!(app.pay(Some(&new_key()), 1).await.status, 201);
    }
    let name = url.rsplit('/').next().unwrap().to_owned();
    let mut admin = PgConnection::connect(&database_url()).await.unwrap();
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT application_name FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE 'oncepay%'
          ORDER BY 1",
    )
    .bind(&name)
    .fetch_all(&mut admin)
    .await
    .unwrap();
    // Through PgBouncer a server session carries the name of whichever client used it last.
    if !through_pooler() {
        assert_eq!(names, ["oncepay", "oncepay-replica-7"], "one name per server");
    }
    for app in [named, unnamed] {
        app.state.db.close().await;
        app.state.lists.close().await;
    }
    drop_database(&url).await;
}

#[tokio::test]
async fn a_connection_goes_back_to_the_pool_and_serves_the_next_call() {
    let db = Db::direct(database_url().parse::<PgConnectOptions>().unwrap(), 1);
    let first = backend_pid(&db).await;
    for _ in 0..3 {
        assert_eq!(backend_pid(&db).await, first, "the same connection, reused");
    }
    assert_eq!(db.status().size, 1);
    db.close().await;
}

#[tokio::test]
async fn a_call_cancelled_midway_closes_its_connection_instead_of_returning_it() {
    let db = Db::direct(database_url().parse::<PgConnectOptions>().unwrap(), 1);
    let before = backend_pid(&db).await;

    let sleeping = db.run(async |c| c.execute("SELECT pg_sleep(30)").await);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), sleeping)
            .await
            .is_err(),
        "the call was cancelled while PostgreSQL was still running it"
    );

    // Returned as it was, the connection would make the next call wait for the sleep to end.
    let started = Instant::now();
    let after = backend_pid(&db).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the next call did not inherit the cancelled one: {:?}",
        started.elapsed()
    );
    assert_ne!(after, before, "a new connection");
    assert_eq!(db.status().size, 1, "the cancelled connection left the pool");
    assert_eq!(db.connections_closed().with_label_values(&["abandoned"]).get(), 1);
    assert_eq!(db.connections_closed().with_label_values(&["broken"]).get(), 0);

    // The abandoned backend is stopped too, so that it does not sleep on for 30 s.
    let mut admin = PgConnection::connect(&database_url()).await.unwrap();
    admin
        .execute(format!("SELECT pg_cancel_backend({before})").as_str())
        .await
        .unwrap();
    db.close().await;
}
