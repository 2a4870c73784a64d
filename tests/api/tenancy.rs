//! docs/api.md, authentication: tenants never see each other.

use oncepay::domain::MissingKeyPolicy;
use serde_json::json;

use crate::support::helpers::{new_key, new_tenant, spawn_app, MAIN_BALANCE};

#[tokio::test]
async fn the_same_key_string_in_two_tenants_is_two_keys() {
    let app = spawn_app().await;
    let (other_tenant, other_key) = new_tenant(&app.pool, MissingKeyPolicy::Reject).await;
    let key = "shared-key-string";

    let mine = app.pay(Some(key), 100).await;
    let theirs = app
        .post_as(&other_key, "/payments", Some(key), &json!({ "amount": 700 }))
        .await;

    assert_eq!(mine.status, 201);
    assert_eq!(theirs.status, 201, "not a 422: another tenant's key is unrelated");
    assert!(!theirs.replayed());
    assert_ne!(mine.body["id"], theirs.body["id"]);
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
    let their_balance: i64 =
        sqlx::query_scalar("SELECT balance FROM accounts WHERE tenant_id = $1 AND account_id = 'main'")
            .bind(other_tenant)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(their_balance, MAIN_BALANCE - 700);
}

#[tokio::test]
async fn another_tenants_ids_answer_404() {
    let app = spawn_app().await;
    let (_, other_key) = new_tenant(&app.pool, MissingKeyPolicy::Reject).await;
    let paid = app.pay(Some(&new_key()), 100).await;
    let id = paid.body["id"].as_str().unwrap();
    app.open_account("private", 50).await;

    app.get_as(&other_key, &format!("/payments/{id}"))
        .await
        .assert_problem(404, "not_found");
    app.post_as(
        &other_key,
        &format!("/payments/{id}/refund"),
        Some(&new_key()),
        &json!({}),
    )
    .await
    .assert_problem(404, "not_found");
    app.get_as(&other_key, "/accounts/private")
        .await
        .assert_problem(404, "account_not_found");
    app.post_as(
        &other_key,
        "/accounts/private/deposits",
        Some(&new_key()),
        &json!({ "amount": 1 }),
    )
    .await
    .assert_problem(404, "account_not_found");
    app.post_as(
        &other_key,
        "/payments",
        Some(&new_key()),
        &json!({ "amount": 1, "account": "private" }),
    )
    .await
    .assert_problem(404, "account_not_found");

    assert_eq!(
        app.balance("main").await,
        MAIN_BALANCE - 100,
        "the refund did not happen"
    );
    assert_eq!(app.balance("private").await, 50);
    let mine = app.get(&format!("/payments/{id}")).await;
    assert_eq!(mine.body["status"], "succeeded");
}

#[tokio::test]
async fn api_keys_are_stored_only_hashed() {
    let app = spawn_app().await;
    let stored: Vec<u8> = sqlx::query_scalar("SELECT api_key_hash FROM tenants WHERE tenant_id = $1")
        .bind(app.tenant_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(stored.len(), 32);
    assert!(!String::from_utf8_lossy(&stored).contains(&app.api_key));
    let plain_anywhere: i64 = sqlx::query_scalar("SELECT count(*) FROM tenants t WHERE t::text LIKE '%' || $1 || '%'")
        .bind(&app.api_key[4..])
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(plain_anywhere, 0);
}
