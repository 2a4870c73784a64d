//! `GET /openapi.json`: the document of the whole API, served without authentication.

use crate::support::helpers::{spawn_app, Answer};

#[tokio::test]
async fn the_openapi_document_is_served_without_authentication() {
    let app = spawn_app().await;

    let answer = Answer::from(app.client.get(app.url("/openapi.json")).send().await.unwrap()).await;

    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("content-type"), Some("application/json"));
    let served = answer.body;
    let generated: serde_json::Value = serde_json::from_str(&oncepay::routes::openapi_document()).unwrap();
    assert_eq!(served, generated);
    assert!(served["openapi"].as_str().unwrap().starts_with("3."));
    assert_eq!(
        served["paths"]["/payments"]["post"]["security"][0]["api_key"],
        serde_json::json!([])
    );
}
