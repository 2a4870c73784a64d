//! Issue 6, part 4, continued: header and body sizes are bounded on every endpoint, and
//! requests that lie about their framing or length cannot hold the server.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{json, Value};

use crate::hardening::send;
use crate::security::raw_http;
use crate::support::helpers::{new_key, spawn_app, spawn_app_with, Answer, ADMIN_TOKEN};

/// actix-http bounds the head of a request (128 KiB, 96 headers) and answers 431 before any
/// route runs (a problem: `src/http1.rs`); the server keeps serving others.
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
        crate::framing::problem(&answer, 431, "headers_too_large");
    }
    assert_eq!(crate::framing::rejected(&app, "headers_too_large"), 2, "each counted");
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

/// A request whose framing is malformed never reaches a route: actix-http answers 400 (a
/// problem: `src/http1.rs`) and closes the connection.
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
        crate::framing::problem(&answer, 400, "invalid_request");
    }
    let started = Instant::now();
    let health = Answer::from(app.client.get(app.url("/healthz")).send().await.unwrap()).await;
    assert_eq!(health.status, 200);
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(app.payment_count().await, 0);
}

/// A client that announces a body over the limit and then sends nothing gets its 413 at
/// once, instead of holding the connection until it gives up.
#[tokio::test]
async fn a_declared_length_over_the_limit_is_413_before_the_body_arrives() {
    let app = spawn_app_with(|s| s.max_body_bytes = 1_000).await;
    let request = format!(
        "POST /payments HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nIdempotency-Key: {}\r\n\
         Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n{{}}",
        app.api_key,
        new_key()
    );
    let started = Instant::now();

    let answer = raw_http(&app, request.into_bytes(), Duration::from_secs(3)).await;

    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("body_too_large"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "answered without waiting for the body"
    );
}

/// A client that sends requests and never reads the answers cannot hold its connection: once
/// a write has made no progress for `WRITE_STALL_TIMEOUT` (30 s) the server drops it. Here 400
/// pipelined reads of the 57 KB OpenAPI document (23 MB of answers) on a socket with a small
/// receive buffer; after the timeout, reading what is left ends early, at the close.
#[tokio::test]
async fn a_client_that_stops_reading_is_disconnected_after_the_write_stall_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const REQUESTS: usize = 400;
    let app = spawn_app().await;
    let document = app.get("/openapi.json").await.body.to_string().len();
    let port: u16 = app.address.rsplit(':').next().unwrap().parse().unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(([127, 0, 0, 1], port).into()).await.unwrap();
    let request = "GET /openapi.json HTTP/1.1\r\nHost: oncepay\r\n\r\n".repeat(REQUESTS);
    stream.write_all(request.as_bytes()).await.unwrap();

    tokio::time::sleep(oncepay::http1::WRITE_STALL_TIMEOUT + Duration::from_secs(10)).await;
    let mut received = 0usize;
    let mut buf = vec![0u8; 1 << 16];
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => received += n,
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the connection was still open: {received} bytes read");
    assert!(
        received < REQUESTS * document,
        "the server gave up before writing every answer ({received} of at least {} bytes)",
        REQUESTS * document
    );
}
