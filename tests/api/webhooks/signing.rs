//! Signatures (Standard Webhooks v1): with and without `ONCEPAY_WEBHOOK_SECRET_KEY`, and
//! across a secret's rotation.

use std::collections::BTreeMap;

use serde_json::json;

use super::{committed, delivering, delivering_app, pay, subscribe, WAIT};
use crate::support::helpers::{new_key, TestApp};
use crate::support::webhook_receiver::Receiver;

/// A server without `ONCEPAY_WEBHOOK_SECRET_KEY` (a new user's first `oncepay serve`) still
/// registers endpoints and delivers signed events (contract 4c names no such setting); the
/// secret is then stored as it is, marked so (`webhooks::secrets`' unit tests show that a key
/// set later still opens it).
#[tokio::test]
async fn without_a_secret_key_webhooks_are_registered_and_delivered_signed() {
    let app = TestApp::builder()
        .settings(|s| {
            delivering(s);
            s.webhooks.secret_key = None;
        })
        .spawn()
        .await;
    let receiver = Receiver::start().await;
    let answer = app
        .post(
            "/webhook-endpoints",
            Some(&new_key()),
            &json!({ "url": receiver.url(), "events": ["payment.succeeded"] }),
        )
        .await;
    assert_eq!(answer.status, 201, "{}", answer.body);
    let secret = answer.body["secret"].as_str().unwrap();
    receiver.set_secret(secret);
    let stored: Vec<u8> = sqlx::query_scalar("SELECT secret_encrypted FROM webhook_endpoints WHERE tenant_id = $1")
        .bind(app.tenant_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(stored[0], 0, "marked as stored unencrypted");
    assert_eq!(&stored[1..], secret.as_bytes());
    let first = pay(&app, 5).await;
    let second = pay(&app, 6).await;
    receiver.wait_for_acknowledged(2, WAIT).await;
    let report = receiver.check(&BTreeMap::from([
        (first, vec!["payment.succeeded"]),
        (second, vec!["payment.succeeded"]),
    ]));
    assert_eq!(report.events, 2, "{report:?}");
}

/// A rotation: the new secret signs at once, the previous one beside it during the overlap
/// (two signatures: a receiver holding either verifies), then alone.
#[tokio::test]
async fn a_rotated_secret_signs_beside_the_previous_one_during_the_overlap() {
    let app = delivering_app().await;
    let receiver = Receiver::start().await;
    let endpoint = subscribe(&app, &receiver, None).await;
    let listed = app.get("/webhook-endpoints").await.body;
    assert_eq!(listed[0]["id"], endpoint);
    // Before a rotation: one secret, one signature (the receiver holds that secret).
    pay(&app, 1).await;
    receiver.wait_for_acknowledged(1, WAIT).await;
    let first = receiver.messages()[0].headers["webhook-signature"].clone();
    assert_eq!(first.split(' ').count(), 1, "{first}");

    let key = new_key();
    let path = format!("/webhook-endpoints/{endpoint}/rotate-secret");
    let rotated = app.post(&path, Some(&key), &json!({ "overlap_secs": 3600 })).await;
    assert_eq!(rotated.status, 200, "{}", rotated.body);
    let new_secret = rotated.body["secret"].as_str().unwrap().to_owned();
    assert!(rotated.body["previous_secret_expires_at"].is_string());
    let replay = app.post(&path, Some(&key), &json!({ "overlap_secs": 3600 })).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, rotated.body);

    // The receiver still holds the old secret: messages verify during the overlap.
    pay(&app, 1).await;
    receiver.wait_for_acknowledged(2, WAIT).await;
    let last = receiver.messages().last().unwrap().clone();
    let signatures = &last.headers["webhook-signature"];
    assert_eq!(signatures.split(' ').count(), 2, "{signatures}");
    let verify = |secret: &str| {
        oncepay_client::webhooks::verify(
            secret,
            &last.headers["webhook-id"],
            &last.headers["webhook-timestamp"],
            signatures,
            &last.raw_body,
        )
    };
    verify(&new_secret).unwrap();
    // Which the receiver's check did with the old one (every signature verified).
    receiver.check(&committed(&app).await);

    // No overlap: the new secret alone.
    receiver.set_secret(&new_secret);
    let again = app.post(&path, Some(&new_key()), &json!({ "overlap_secs": 0 })).await;
    assert_eq!(again.status, 200);
    receiver.set_secret(again.body["secret"].as_str().unwrap());
    pay(&app, 1).await;
    receiver.wait_for_acknowledged(3, WAIT).await;
    let last = receiver.messages().last().unwrap().clone();
    assert_eq!(last.headers["webhook-signature"].split(' ').count(), 1);
    receiver.check(&committed(&app).await);

    // Another tenant's endpoint, or none: 404, stored and replayed like any decline.
    let stranger = TestApp::builder().spawn().await;
    let key = new_key();
    stranger
        .post(&path, Some(&key), &json!({}))
        .await
        .assert_problem(404, "not_found");
    let replayed = stranger.post(&path, Some(&key), &json!({})).await;
    replayed.assert_problem(404, "not_found");
    assert!(replayed.replayed());
    let bad = app
        .post(&path, Some(&new_key()), &json!({ "overlap_secs": 604_801 }))
        .await;
    bad.assert_problem(400, "invalid_request");
}
