//! Issue 6, part 4: security checks as tests. Tenants never reach each other's data,
//! credentials are compared without leaking through timing and stored only hashed, errors
//! carry no internals, and header and body sizes are bounded.

use reqwest::Method;
use serde_json::json;

use crate::helpers::spawn_app;

/// Found by schemathesis: a NUL in a tenant's name reached PostgreSQL (which refuses it in
/// text) and answered 500. Control characters are now refused up front.
#[tokio::test]
async fn tenant_names_with_control_characters_are_400_and_create_nothing() {
    let app = spawn_app().await;
    for name in ["a\u{0}b", "bell\u{7}", "line\nbreak", "c1\u{85}"] {
        app.admin(Method::POST, "/admin/tenants", Some(&json!({ "name": name })))
            .await
            .assert_problem(400, "invalid_request");
    }
    let created = app
        .admin(
            Method::POST,
            "/admin/tenants",
            Some(&json!({ "name": "Zoë & Co — ünïcode" })),
        )
        .await;

    assert_eq!(created.status, 201, "{}", created.body);
    let refused: i64 = sqlx::query_scalar("SELECT count(*) FROM tenants WHERE name ~ '[[:cntrl:]]'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(refused, 0);
}
