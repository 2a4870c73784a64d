//! `POST /admin/tenants` with an `Idempotency-Key` (docs/api.md, admin): a retried creation
//! makes no second tenant and no second `main_balance`, on one replica or several at once; the
//! same key with another body, or past its window, is refused; without a key every call
//! creates (as the operator asked).

use futures_util::future::join_all;
use reqwest::Method;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::helpers::{new_key, Answer, TestApp, ADMIN_TOKEN};

async fn create(app: &TestApp, key: Option<&str>, body: &Value) -> Answer {
    let mut request = app
        .client
        .post(app.url("/admin/tenants"))
        .bearer_auth(ADMIN_TOKEN)
        .json(body);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    Answer::from(request.send().await.unwrap()).await
}

/// Tenants of this name, with their API keys and `main` balances.
async fn made(app: &TestApp, name: &str) -> Vec<(Uuid, i64, i64)> {
    sqlx::query_as(
        "SELECT t.tenant_id,
                (SELECT count(*) FROM api_keys k WHERE k.tenant_id = t.tenant_id),
                (SELECT balance FROM accounts a WHERE a.tenant_id = t.tenant_id AND a.account_id = 'main')
           FROM tenants t WHERE t.name = $1",
    )
    .bind(name)
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn retries_of_a_keyed_creation_on_two_replicas_at_once_make_one_tenant_with_one_balance() {
    let apps = TestApp::builder().spawn_instances(2).await;
    let name = format!("shop-{}", new_key());
    let body = json!({ "name": name, "main_balance": 5_000, "missing_key_policy": "allow" });
    let key = new_key();
    let answers = join_all((0..8).map(|i| create(&apps[i % 2], Some(&key), &body))).await;

    let tenants = made(&apps[0], &name).await;
    assert_eq!(tenants.len(), 1, "one tenant: {tenants:?}");
    let (tenant_id, keys, balance) = tenants[0];
    assert_eq!((keys, balance), (1, 5_000), "one API key, one opening balance");
    let mut first = None;
    for answer in &answers {
        assert_eq!(answer.status, 201, "{}", answer.body);
        assert_eq!(answer.body["tenant_id"], tenant_id.to_string());
        assert_eq!(answer.body["name"], name.as_str());
        assert_eq!(answer.body["missing_key_policy"], "allow");
        if answer.replayed() {
            assert_eq!(answer.body["api_key"], Value::Null, "a replay cannot show the key");
        } else {
            assert_eq!(answer.header("idempotency-replayed"), Some("false"));
            assert!(
                first
                    .replace(answer.body["api_key"].as_str().unwrap().to_owned())
                    .is_none(),
                "one first answer"
            );
        }
    }
    // The first answer's key is the tenant's.
    let api_key = first.expect("a first answer");
    let main = apps[1].get_as(&api_key, "/accounts/main").await;
    assert_eq!(
        (main.status, main.body["balance"].clone()),
        (200, json!(5_000)),
        "{}",
        main.body
    );
    // Later, from either replica: the same tenant again.
    let later = create(&apps[1], Some(&key), &body).await;
    assert!(
        later.replayed() && later.body["tenant_id"] == tenant_id.to_string(),
        "{}",
        later.body
    );
    assert_eq!(made(&apps[0], &name).await.len(), 1);
}

#[tokio::test]
async fn a_creation_key_with_another_body_past_its_window_or_malformed_is_refused_and_makes_nothing() {
    let app = TestApp::builder().spawn().await;
    let name = format!("shop-{}", new_key());
    let key = new_key();
    let first = create(&app, Some(&key), &json!({ "name": name })).await;
    assert_eq!(first.status, 201, "{}", first.body);

    let other = format!("{name}-other");
    create(&app, Some(&key), &json!({ "name": other }))
        .await
        .assert_problem(422, "idempotency_key_reused");
    create(&app, Some(&key), &json!({ "name": name, "main_balance": 1 }))
        .await
        .assert_problem(422, "idempotency_key_reused");
    assert!(made(&app, &other).await.is_empty());

    sqlx::query("UPDATE tenants SET creation_expires_at = now() - interval '1 second' WHERE name = $1")
        .bind(&name)
        .execute(&app.pool)
        .await
        .unwrap();
    create(&app, Some(&key), &json!({ "name": name }))
        .await
        .assert_problem(422, "idempotency_key_expired");
    assert_eq!(made(&app, &name).await.len(), 1, "never made again");

    let bad = format!("{name}-bad");
    create(&app, Some("with space"), &json!({ "name": bad }))
        .await
        .assert_problem(400, "invalid_idempotency_key");
    assert!(made(&app, &bad).await.is_empty());
}

#[tokio::test]
async fn without_a_key_each_creation_makes_a_tenant() {
    let app = TestApp::builder().spawn().await;
    let name = format!("shop-{}", new_key());
    for _ in 0..2 {
        let answer = app
            .admin(Method::POST, "/admin/tenants", Some(&json!({ "name": name })))
            .await;
        assert_eq!(answer.status, 201, "{}", answer.body);
        assert_eq!(answer.header("idempotency-replayed"), None);
        assert!(answer.body["api_key"].as_str().unwrap().starts_with("opk_"));
    }
    assert_eq!(made(&app, &name).await.len(), 2);
}
