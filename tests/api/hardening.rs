//! Issue 6, part 4, continued: errors carry no internals and are problem+json wherever the
//! application answers, whatever the input.

use oncepay::routes::schemas::PROBLEM_CODES;
use oncepay_protocol::ProblemCode;
use reqwest::Method;
use serde_json::json;

use crate::support::helpers::{
    documented_endpoints, fill, new_key, spawn_app, tenant_post_paths, Answer, TestApp, ADMIN_TOKEN,
};

/// What must never reach a client: SQL, driver and PostgreSQL messages, Rust panics and
/// backtraces.
const LEAKS: &[&str] = &[
    "select ",
    "insert ",
    "update ",
    "sqlx",
    "postgres",
    "sqlstate",
    "relation ",
    "syntax error",
    "invalid byte",
    "panicked",
    "stack backtrace",
    "src/",
    ".rs:",
    "thread '",
    "unwrap",
];

#[track_caller]
fn assert_clean_problem(answer: &Answer, what: &str) {
    assert!(
        answer.status >= 400 && answer.status < 500,
        "{what}: {} {}",
        answer.status,
        answer.body
    );
    assert_eq!(
        answer.header("content-type"),
        Some("application/problem+json"),
        "{what}"
    );
    assert!(
        PROBLEM_CODES.contains(&answer.code()),
        "{what}: undocumented code {}",
        answer.body
    );
    let code: ProblemCode = answer
        .code()
        .parse()
        .unwrap_or_else(|e| panic!("{what}: {e} in {}", answer.body));
    assert_eq!(
        code.status(),
        answer.status,
        "{what}: {code} answered with another status"
    );
    let text = answer.body.to_string().to_lowercase();
    for leak in LEAKS {
        assert!(!text.contains(leak), "{what}: `{leak}` leaked in {text}");
    }
}

/// The OpenAPI document lists exactly the codes of the protocol the client shares.
#[test]
fn the_documented_problem_codes_are_the_shared_ones() {
    let mut documented: Vec<&str> = PROBLEM_CODES.to_vec();
    let mut shared: Vec<&str> = ProblemCode::ALL.iter().map(|code| code.as_str()).collect();
    documented.sort_unstable();
    shared.sort_unstable();
    assert_eq!(documented, shared);
}

pub async fn send(
    app: &TestApp,
    method: Method,
    path: &str,
    token: &str,
    key: Option<&str>,
    body: Option<Vec<u8>>,
) -> Answer {
    let mut request = app.client.request(method, app.url(path)).bearer_auth(token);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    if let Some(body) = body {
        request = request.header("Content-Type", "application/json").body(body);
    }
    Answer::from(request.send().await.unwrap()).await
}

/// Every endpoint that takes input, fed hostile values: each answers a clean 4xx problem.
#[tokio::test]
async fn hostile_input_on_every_endpoint_answers_a_clean_problem() {
    let app = spawn_app().await;
    let nasty_strings = [
        "'; DROP TABLE payments; --",
        "\u{0}",
        "a\u{0}b",
        "\\x00",
        "%00",
        "${jndi:ldap://x}",
        "𝕦𝕟𝕚𝕔𝕠𝕕𝕖",
        "\u{202e}rtl",
    ];
    let deep = (0..200).fold(json!(1), |inner, _| json!([inner]));
    let mut bodies: Vec<Vec<u8>> = vec![
        b"\xff\xfe\x00".to_vec(),
        b"{\"amount\": 1e400}".to_vec(),
        b"{\"amount\": -0}".to_vec(),
        b"{\"amount\": 99999999999999999999999999}".to_vec(),
        serde_json::to_vec(&json!({ "amount": deep })).unwrap(),
    ];
    for s in nasty_strings {
        for body in [
            json!({ "amount": s }),
            json!({ "amount": 1, "account": s }),
            json!({ "id": s }),
            json!({ "name": s, "missing_key_policy": s }),
            json!({ s: 1 }),
        ] {
            bodies.push(serde_json::to_vec(&body).unwrap());
        }
    }
    let id = "%27%20OR%201=1%20--";
    // Every documented tenant POST, its path parameter an existing account or an unknown id.
    let tenant_posts = tenant_post_paths();
    assert!(tenant_posts.iter().any(|p| p == "/transfers"), "{tenant_posts:?}");

    for body in &bodies {
        for path in &tenant_posts {
            let answer = send(
                &app,
                Method::POST,
                path,
                &app.api_key,
                Some(&new_key()),
                Some(body.clone()),
            )
            .await;
            assert_clean_problem(&answer, &format!("POST {path} {}", String::from_utf8_lossy(body)));
        }
        let admin = send(
            &app,
            Method::POST,
            "/admin/tenants",
            ADMIN_TOKEN,
            None,
            Some(body.clone()),
        )
        .await;
        assert_clean_problem(
            &admin,
            &format!("POST /admin/tenants {}", String::from_utf8_lossy(body)),
        );
        let patch_path = format!("/admin/tenants/{}", app.tenant_id);
        let patch = send(&app, Method::PATCH, &patch_path, ADMIN_TOKEN, None, Some(body.clone())).await;
        assert_clean_problem(&patch, &format!("PATCH tenant {}", String::from_utf8_lossy(body)));
    }
    for key in nasty_strings.iter().filter(|k| k.is_ascii() && !k.contains('\0')) {
        let answer = send(
            &app,
            Method::POST,
            "/payments",
            &app.api_key,
            Some(&format!("{key} x")),
            Some(b"{}".to_vec()),
        )
        .await;
        assert_clean_problem(&answer, &format!("key {key}"));
    }
    // Every documented path with a parameter, the parameter hostile; and a few broken paths.
    let hostile_paths = documented_endpoints()
        .into_iter()
        .filter(|(_, template)| template.contains('{'))
        .map(|(_, template)| fill(&template, id))
        .collect::<std::collections::BTreeSet<_>>();
    assert!(
        hostile_paths.iter().any(|p| p.starts_with("/transfers/")),
        "{hostile_paths:?}"
    );
    for path in hostile_paths.into_iter().chain([
        "/accounts/%FF%FE".to_owned(),
        "/payments/%00".to_owned(),
        "/nowhere/%ZZ".to_owned(),
    ]) {
        for method in [Method::GET, Method::POST, Method::PATCH, Method::DELETE] {
            let token = if path.starts_with("/admin") {
                ADMIN_TOKEN
            } else {
                &app.api_key
            };
            let answer = send(
                &app,
                method.clone(),
                &path,
                token,
                Some(&new_key()),
                Some(b"{}".to_vec()),
            )
            .await;
            assert_clean_problem(&answer, &format!("{method} {path}"));
        }
    }
    assert_eq!(app.payment_count().await, 0, "no hostile request was processed");
}
