//! Rule 10: requests without a key, under each of the tenant's policies.

use std::time::Duration;

use reqwest::Method;
use serde_json::json;

use crate::support::helpers::{new_key, spawn_app, spawn_app_with, spawn_instances, TestApp, MAIN_BALANCE};

#[tokio::test]
async fn under_allow_keyless_requests_are_processed_without_protection() {
    let app = spawn_app().await;
    app.set_policy("allow").await;

    let first = app.pay(None, 100).await;
    let second = app.pay(None, 100).await;
    // A decline was processed unprotected too: counted as it is logged (found from outside:
    // logged, not counted).
    let declined = app.pay(None, MAIN_BALANCE + 1).await;

    assert_eq!((first.status, second.status), (201, 201));
    declined.assert_problem(402, "insufficient_funds");
    assert!(first.header("idempotency-replayed").is_none());
    assert_eq!(
        app.balance("main").await,
        MAIN_BALANCE - 200,
        "the double charge a key prevents"
    );
    assert_eq!(app.key_count().await, 0);
    let metrics = app.metrics().await;
    assert!(
        metrics.contains(r#"oncepay_requests_total{outcome="keyless",route="/payments"} 2"#),
        "{metrics}"
    );
    let by_tenant = format!(r#"oncepay_keyless_requests_total{{tenant="{}"}} 3"#, app.tenant_id);
    assert!(metrics.contains(&by_tenant), "{metrics}");
}

/// Under `allow` the warning that keyless requests go unprotected comes once a minute, with
/// the count since, not once a request: each request's own line says `outcome="keyless"`
/// (found in a soak: 8,464 WARN lines an hour from one tenant).
#[tokio::test]
async fn under_allow_the_warning_comes_once_a_minute_and_each_request_line_says_keyless() {
    use crate::commands::{free_port, serve_logged, stop_logged, wait_until_ready};
    let app = spawn_app().await;
    app.set_policy("allow").await;
    let port = free_port();
    let (mut server, logs) = serve_logged(&[
        (
            "DATABASE_URL",
            crate::support::helpers::server_url(&crate::support::helpers::database_url()),
        ),
        ("ONCEPAY_BIND", format!("127.0.0.1:{port}")),
        ("ONCEPAY_METRICS_BIND", "127.0.0.1:0".to_owned()),
        ("ONCEPAY_LOG_FORMAT", "json".to_owned()),
        ("RUST_LOG", "info".to_owned()),
    ]);
    wait_until_ready(&app.client, port).await;
    for _ in 0..20 {
        let paid = app
            .client
            .post(format!("http://127.0.0.1:{port}/payments"))
            .bearer_auth(&app.api_key)
            .json(&json!({ "amount": 1 }))
            .send()
            .await
            .unwrap();
        assert_eq!(paid.status(), 201);
    }
    let log = stop_logged(&mut server, logs).await;
    let lines: Vec<serde_json::Value> = log.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let warnings: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["message"].as_str().is_some_and(|m| m.starts_with("keyless request")))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    assert_eq!(warnings[0]["level"], "WARN");
    let keyless = lines
        .iter()
        .filter(|l| l["message"] == "request" && l["outcome"] == "keyless" && l["route"] == "/payments")
        .count();
    assert_eq!(keyless, 20, "{log}");
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 20);
}

#[tokio::test]
async fn under_allow_a_keyed_request_is_still_protected() {
    let app = spawn_app().await;
    app.set_policy("allow").await;
    let key = new_key();
    app.pay(Some(&key), 100).await;
    assert!(app.pay(Some(&key), 100).await.replayed());
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
}

#[tokio::test]
async fn a_policy_change_takes_effect_on_the_next_request() {
    let app = spawn_app().await;
    app.pay(None, 100).await.assert_problem(400, "missing_idempotency_key");
    app.set_policy("allow").await;
    // The tenant cache lives for under a second (contract: within one second on every replica).
    tokio::time::sleep(oncepay::auth::TENANT_CACHE_TTL).await;
    assert_eq!(app.pay(None, 100).await.status, 201);
    app.set_policy("reject").await;
    tokio::time::sleep(oncepay::auth::TENANT_CACHE_TTL).await;
    app.pay(None, 100).await.assert_problem(400, "missing_idempotency_key");
}

#[tokio::test]
async fn patching_an_unknown_tenant_or_with_a_bad_policy_is_refused() {
    let app = spawn_app().await;
    let unknown = app
        .admin(
            Method::PATCH,
            &format!("/admin/tenants/{}", uuid::Uuid::new_v4()),
            Some(&json!({ "missing_key_policy": "allow" })),
        )
        .await;
    unknown.assert_problem(404, "not_found");
    let bad = app
        .admin(
            Method::PATCH,
            &format!("/admin/tenants/{}", app.tenant_id),
            Some(&json!({ "missing_key_policy": "sometimes" })),
        )
        .await;
    bad.assert_problem(400, "invalid_request");
    // Found from outside: serde's derive took the map form `{"allow": null}` (200, policy
    // set) and spoke of "unit" and "map". Only the three strings, in their words.
    for form in [json!({ "allow": null }), json!(null), json!(["allow"])] {
        let refused = app
            .admin(
                Method::PATCH,
                &format!("/admin/tenants/{}", app.tenant_id),
                Some(&json!({ "missing_key_policy": form })),
            )
            .await;
        refused.assert_problem(400, "invalid_request");
        let detail = refused.body["detail"].as_str().unwrap();
        assert!(
            detail.contains(r#"must be one of "reject", "allow", "fingerprint""#),
            "{form}: {detail}"
        );
    }
    let policy: String = sqlx::query_scalar("SELECT missing_key_policy FROM tenants WHERE tenant_id = $1")
        .bind(app.tenant_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(policy, "reject", "unchanged");
}

#[tokio::test]
async fn under_fingerprint_an_identical_keyless_request_inside_the_window_is_replayed() {
    let app = spawn_app().await;
    app.set_policy("fingerprint").await;

    let first = app.pay(None, 100).await;
    let second = app.pay(None, 100).await;
    let different = app.pay(None, 101).await;

    assert_eq!(first.status, 201);
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(different.status, 201);
    assert!(!different.replayed());
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 201);
    let derived: String = sqlx::query_scalar("SELECT key FROM idempotency_keys WHERE tenant_id = $1 LIMIT 1")
        .bind(app.tenant_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(derived.starts_with("fp:") && derived.len() == 3 + 64, "{derived}");
}

#[tokio::test]
async fn under_fingerprint_a_keyless_request_after_the_window_is_processed_anew() {
    let app = spawn_app_with(|s| s.fingerprint_window = Duration::from_secs(1)).await;
    app.set_policy("fingerprint").await;
    let first = app.pay(None, 100).await;
    tokio::time::sleep(Duration::from_millis(1_100)).await;

    let later = app.pay(None, 100).await;

    assert_eq!(later.status, 201, "derived keys never answer expired: {}", later.body);
    assert!(!later.replayed());
    assert_ne!(later.body["id"], first.body["id"]);
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 200);
    assert!(app.pay(None, 100).await.replayed(), "and the new window replays again");
}

#[tokio::test]
async fn concurrent_identical_keyless_requests_over_three_instances_are_processed_once() {
    let apps = spawn_instances(3).await;
    apps[0].set_policy("fingerprint").await;

    let answers = futures_util::future::join_all((0..30).map(|i| apps[i % 3].pay(None, 100))).await;

    let original = answers
        .iter()
        .find(|a| a.status == 201 && !a.replayed())
        .expect("one request was processed");
    for answer in &answers {
        match answer.status {
            201 => assert_eq!(answer.body, original.body, "every 201 has an equal body"),
            _ => answer.assert_problem(409, "request_in_progress"),
        }
    }
    assert_eq!(answers.iter().filter(|a| a.status == 201 && !a.replayed()).count(), 1);
    assert_eq!(apps[0].balance("main").await, MAIN_BALANCE - 100);
}

#[tokio::test]
async fn after_the_window_concurrent_keyless_requests_over_three_instances_renew_the_key_once() {
    // The window must outlast the burst below: a request arriving after the renewed key's
    // window has passed again is rightly processed anew (a loaded machine can take a second).
    let window = Duration::from_secs(3);
    let apps = TestApp::builder()
        .settings(|s| s.fingerprint_window = window)
        .spawn_instances(3)
        .await;
    apps[0].set_policy("fingerprint").await;
    assert_eq!(apps[0].pay(None, 100).await.status, 201);
    tokio::time::sleep(window + Duration::from_millis(100)).await;

    let answers = futures_util::future::join_all((0..30).map(|i| apps[i % 3].pay(None, 100))).await;

    assert_eq!(
        answers.iter().filter(|a| a.status == 201 && !a.replayed()).count(),
        1,
        "exactly one replica processed it"
    );
    assert_eq!(apps[0].balance("main").await, MAIN_BALANCE - 200);
}

/// Found from outside (2026-12-06): a client's key `fp:<H>` sent with another body took the
/// derived key of the keyless request whose fingerprint is H; that request was then refused
/// 422 `idempotency_key_reused`, about a key it never sent, for the client key's 24 hours
/// (and after them it rewrote the client's row). Keys starting with `fp:` are the server's:
/// a client's is refused 400, and takes nothing. A derived key can still be looked up.
#[tokio::test]
async fn a_client_key_in_the_derived_keys_namespace_is_refused_and_takes_nothing() {
    let app = spawn_app().await;
    app.set_policy("fingerprint").await;
    let body = json!({ "amount": 905 });
    let derived = format!(
        "fp:{}",
        hex::encode(oncepay::idempotency::fingerprint("POST", "/payments", &body))
    );

    let squat = app.post("/payments", Some(&derived), &json!({ "amount": 906 })).await;
    let keyless = app.pay(None, 905).await;

    assert_eq!(
        (squat.status, squat.code()),
        (400, "invalid_idempotency_key"),
        "{}",
        squat.body
    );
    assert!(
        squat.body["detail"].as_str().unwrap().contains("`fp:`"),
        "{}",
        squat.body
    );
    assert_eq!(keyless.status, 201, "{}", keyless.body);
    assert!(!keyless.replayed());
    assert_eq!(
        app.balance("main").await,
        MAIN_BALANCE - 905,
        "the squat charged nothing"
    );
    let stored: String = sqlx::query_scalar("SELECT key FROM idempotency_keys WHERE tenant_id = $1")
        .bind(app.tenant_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(stored, derived, "the key the squat aimed at is the one derived");
    let looked_up = app.get(&format!("/idempotency-keys/{derived}")).await;
    assert_eq!(looked_up.status, 200, "{}", looked_up.body);
}
