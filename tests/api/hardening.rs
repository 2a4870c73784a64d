//! Issue 6, part 4, continued: errors carry no internals and are problem+json wherever the
//! application answers, and header and body sizes are bounded on every endpoint.

use std::time::{Duration, Instant};

use oncepay::routes::schemas::PROBLEM_CODES;
use reqwest::Method;
use serde_json::{json, Value};

use crate::helpers::{new_key, spawn_app, spawn_app_with, Answer, TestApp, ADMIN_TOKEN};
use crate::security::raw_http;

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
    let text = answer.body.to_string().to_lowercase();
    for leak in LEAKS {
        assert!(!text.contains(leak), "{what}: `{leak}` leaked in {text}");
    }
}

async fn send(
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
    let tenant_posts = ["/payments", "/pay", "/accounts", "/accounts/main/deposits"];
    let refund = format!("/payments/{}/refund", uuid::Uuid::new_v4());

    for body in &bodies {
        for path in tenant_posts.iter().copied().chain([refund.as_str()]) {
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
    for path in [
        format!("/payments/{id}"),
        format!("/accounts/{id}"),
        format!("/accounts/{id}/deposits"),
        format!("/payments/{id}/refund"),
        format!("/admin/tenants/{id}"),
        "/accounts/%FF%FE".to_owned(),
        "/payments/%00".to_owned(),
        "/nowhere/%ZZ".to_owned(),
    ] {
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

/// actix-http bounds the head of a request (128 KiB, 96 headers) and answers 431 before any
/// route runs; the server keeps serving others.
#[tokio::test]
async fn an_oversized_header_is_431_and_the_server_keeps_serving() {
    let app = spawn_app().await;
    let mut huge = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 200_000));
    huge.extend(b"\r\n\r\n");
    let mut many = b"GET /healthz HTTP/1.1\r\nHost: x\r\n".to_vec();
    for i in 0..200 {
        many.extend(format!("X-H{i}: v\r\n").as_bytes());
    }
    many.extend(b"\r\n");

    for request in [huge, many] {
        let answer = raw_http(&app, request, Duration::from_secs(5)).await;
        assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    }
    let health = Answer::from(app.client.get(app.url("/healthz")).send().await.unwrap()).await;
    assert_eq!(health.status, 200);
}

/// Each body-taking endpoint: one byte over the limit is a 413 problem, exactly the limit
/// is processed.
#[tokio::test]
async fn every_body_over_the_limit_is_413_and_one_of_exactly_the_limit_is_processed() {
    let app = spawn_app_with(|s| s.max_body_bytes = 1_000).await;
    let paid = app.pay(Some(&new_key()), 1).await;
    let refund = format!("/payments/{}/refund", paid.body["id"].as_str().unwrap());
    let patch = format!("/admin/tenants/{}", app.tenant_id);
    let cases: Vec<(Method, &str, &str, Value, u16)> = vec![
        (Method::POST, "/payments", &app.api_key, json!({ "amount": 1 }), 201),
        (Method::POST, "/pay", &app.api_key, json!({ "amount": 1 }), 201),
        (Method::POST, &refund, &app.api_key, json!({}), 200),
        (Method::POST, "/accounts", &app.api_key, json!({ "id": "padded" }), 201),
        (
            Method::POST,
            "/accounts/main/deposits",
            &app.api_key,
            json!({ "amount": 1 }),
            201,
        ),
        (
            Method::POST,
            "/admin/tenants",
            ADMIN_TOKEN,
            json!({ "name": "padded" }),
            201,
        ),
        (
            Method::PATCH,
            &patch,
            ADMIN_TOKEN,
            json!({ "missing_key_policy": "reject" }),
            200,
        ),
    ];
    for (method, path, token, body, success) in cases {
        let mut exact = serde_json::to_vec(&body).unwrap();
        exact.resize(1_000, b' ');
        let mut over = exact.clone();
        over.push(b' ');

        let too_large = send(&app, method.clone(), path, token, Some(&new_key()), Some(over)).await;
        too_large.assert_problem(413, "body_too_large");
        let accepted = send(&app, method.clone(), path, token, Some(&new_key()), Some(exact)).await;
        assert_eq!(accepted.status, success, "{method} {path}: {}", accepted.body);
    }
}

/// A chunked body has no declared length: it is cut at the limit as it streams in.
#[tokio::test]
async fn a_chunked_body_over_the_limit_is_413() {
    let app = spawn_app_with(|s| s.max_body_bytes = 1_000).await;
    let mut request = format!(
        "POST /payments HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nIdempotency-Key: {}\r\n\
         Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        app.api_key,
        new_key()
    )
    .into_bytes();
    for _ in 0..11 {
        request.extend(format!("64\r\n{}\r\n", " ".repeat(100)).as_bytes());
    }
    request.extend(b"0\r\n\r\n");

    let answer = raw_http(&app, request, Duration::from_secs(5)).await;

    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");
    assert_eq!(app.payment_count().await, 0);
}

/// A request whose framing is malformed never reaches a route: actix-http answers an empty
/// 400 and closes the connection (no problem+json is possible before a request exists).
#[tokio::test]
async fn malformed_framing_is_400_and_the_server_keeps_serving() {
    let app = spawn_app().await;
    let head = format!(
        "POST /payments HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n",
        app.api_key
    );
    for framing in [
        "Content-Length: abc\r\n\r\n{}",
        "Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        "Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
    ] {
        let answer = raw_http(&app, format!("{head}{framing}").into_bytes(), Duration::from_secs(5)).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{framing}: {answer}");
    }
    let started = Instant::now();
    let health = Answer::from(app.client.get(app.url("/healthz")).send().await.unwrap()).await;
    assert_eq!(health.status, 200);
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(app.payment_count().await, 0);
}
