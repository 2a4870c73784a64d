//! Registering, listing and deleting endpoints; the URL guard; subscriptions by event type.

use std::time::Duration;

use serde_json::json;
use uuid::Uuid;

use super::{delivering_app, endpoints_stored, pay, refund, subscribe, WAIT};
use crate::support::helpers::{new_key, TestApp};
use crate::support::webhook_receiver::Receiver;

/// Every type the API lists can be named (found from outside: naming
/// `top_up.refund_failed` answered 500, a CHECK of the table lacking it).
#[tokio::test]
async fn every_event_type_can_be_named() {
    let app = TestApp::builder().spawn().await;
    let mut types = oncepay::webhooks::endpoints::EVENT_TYPES.to_vec();
    let body = json!({ "url": "http://127.0.0.1:9/hooks", "events": types });
    let created = app.post("/webhook-endpoints", Some(&new_key()), &body).await;
    assert_eq!(created.status, 201, "{}", created.body);
    types.sort_unstable();
    assert_eq!(created.body["events"], json!(types));
    assert_eq!(created.body["all_events"], false, "named, not every type");
    let alone = json!({ "url": "http://127.0.0.1:9/hooks", "events": ["top_up.refund_failed"] });
    let created = app.post("/webhook-endpoints", Some(&new_key()), &alone).await;
    assert_eq!(created.status, 201, "{}", created.body);
}

#[tokio::test]
async fn an_endpoint_is_created_once_listed_without_its_secret_and_deleted() {
    let app = TestApp::builder().spawn().await;
    let key = new_key();
    let body = json!({ "url": "http://127.0.0.1:9/hooks", "events": ["payment.succeeded", "payment.refunded"] });
    let first = app.post("/webhook-endpoints", Some(&key), &body).await;
    assert_eq!(first.status, 201, "{}", first.body);
    let secret = first.body["secret"].as_str().unwrap();
    assert!(secret.starts_with("whsec_"), "{secret}");
    assert_eq!(first.body["events"], json!(["payment.refunded", "payment.succeeded"]));
    assert_eq!(first.body["all_events"], false, "these types by name");
    assert_eq!(first.header("Idempotency-Replayed"), Some("false"));
    // A replay answers the same endpoint and the same secret; nothing new is stored.
    let replay = app.post("/webhook-endpoints", Some(&key), &body).await;
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    let other = app
        .post(
            "/webhook-endpoints",
            Some(&key),
            &json!({ "url": "http://127.0.0.1:10/" }),
        )
        .await;
    other.assert_problem(422, "idempotency_key_reused");

    // The database holds the secret only encrypted.
    let stored: Vec<u8> = sqlx::query_scalar("SELECT secret_encrypted FROM webhook_endpoints WHERE tenant_id = $1")
        .bind(app.tenant_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let key_bytes = oncepay::webhooks::signing::key_of(secret).unwrap();
    assert!(!stored.windows(key_bytes.len()).any(|w| w == key_bytes.as_slice()));
    assert!(!stored.windows(secret.len()).any(|w| w == secret.as_bytes()));

    let all = app
        .post(
            "/webhook-endpoints",
            Some(&new_key()),
            &json!({ "url": "https://93.184.216.34/x" }),
        )
        .await;
    assert_eq!(all.status, 201, "{}", all.body);
    assert_eq!(
        all.body["events"].as_array().unwrap().len(),
        oncepay::webhooks::endpoints::EVENT_TYPES.len(),
        "every type, top_up.refund_failed included"
    );
    // Found from outside: listed as today's types only, it could not be told from an endpoint
    // that named them; it takes future types too.
    assert_eq!(all.body["all_events"], true, "{}", all.body);

    let listed = app.get("/webhook-endpoints").await;
    assert_eq!(listed.status, 200);
    let listed = listed.body.as_array().unwrap().clone();
    assert_eq!(listed.len(), 2);
    assert!(listed
        .iter()
        .all(|e| e.get("secret").is_none() && e["status"] == "enabled"));
    let mut all_events: Vec<bool> = listed.iter().map(|e| e["all_events"].as_bool().unwrap()).collect();
    all_events.sort_unstable();
    assert_eq!(all_events, [false, true], "as created");

    let id = first.body["id"].as_str().unwrap();
    // Another tenant neither sees nor deletes it.
    let stranger = TestApp::builder().spawn().await;
    assert_eq!(stranger.get("/webhook-endpoints").await.body, json!([]));
    let response = stranger
        .client
        .delete(stranger.url(&format!("/webhook-endpoints/{id}")))
        .bearer_auth(&stranger.api_key)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    let delete = || {
        app.client
            .delete(app.url(&format!("/webhook-endpoints/{id}")))
            .bearer_auth(&app.api_key)
            .send()
    };
    assert_eq!(delete().await.unwrap().status(), 204);
    assert_eq!(delete().await.unwrap().status(), 404);
    // The creation's replay still answers it, but a deleted endpoint's secret no more.
    let gone = app.post("/webhook-endpoints", Some(&key), &body).await;
    assert_eq!((gone.status, gone.replayed()), (201, true), "{}", gone.body);
    assert_eq!(gone.body["id"], first.body["id"]);
    assert_eq!(gone.body["secret"], serde_json::Value::Null, "{}", gone.body);
    assert_eq!(app.get("/webhook-endpoints").await.body.as_array().unwrap().len(), 1);
    app.get("/events/not-an-id").await.assert_problem(404, "not_found");
    app.get(&format!("/events/{}", Uuid::new_v4()))
        .await
        .assert_problem(404, "not_found");
}

#[tokio::test]
async fn private_targets_unknown_events_and_a_server_without_a_key_are_refused() {
    let app = TestApp::builder()
        .settings(|s| s.webhooks.allow_private = false)
        .spawn()
        .await;
    for url in [
        "http://127.0.0.1:8080/x",
        "http://localhost/x",
        "http://10.0.0.1/x",
        "http://192.168.1.10/x",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]/x",
        "http://[fe80::1]/x",
        "ftp://example.com/x",
        "not a url",
        "https://user:pw@example.com/x",
        // Were stored rewritten (found from outside): NUL dropped, CR LF removed.
        "https://93.184.216.34/x\u{0}",
        "https://93.184.216.34/x\r\nX-Evil: 1",
    ] {
        let answer = app
            .post("/webhook-endpoints", Some(&new_key()), &json!({ "url": url }))
            .await;
        answer.assert_problem(400, "invalid_request");
    }
    for events in [json!([]), json!(["payment.created"]), json!("payment.succeeded")] {
        let answer = app
            .post(
                "/webhook-endpoints",
                Some(&new_key()),
                &json!({ "url": "https://93.184.216.34/", "events": events }),
            )
            .await;
        answer.assert_problem(400, "invalid_request");
    }
    let unknown_field = app
        .post(
            "/webhook-endpoints",
            Some(&new_key()),
            &json!({ "url": "https://93.184.216.34/", "secret": "x" }),
        )
        .await;
    unknown_field.assert_problem(400, "invalid_request");
    assert_eq!(endpoints_stored(&app).await, 0);
}

#[tokio::test]
async fn an_endpoint_receives_only_the_types_it_subscribed_to() {
    let app = delivering_app().await;
    let refunds = Receiver::start().await;
    subscribe(&app, &refunds, Some(&["payment.refunded"])).await;
    let payment = pay(&app, 10).await;
    refund(&app, &payment).await;
    refunds.wait_for_acknowledged(1, WAIT).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let messages = refunds.messages();
    assert!(
        messages.iter().all(|m| m.event_type == "payment.refunded"),
        "{messages:?}"
    );
}
