//! Issue 12, part 4: requests that actix-http rejects before any route runs (a head it cannot
//! parse, one too large, one too slow) are answered problem+json with a `code` too
//! (`src/http1.rs`), over raw TCP to the real server. The head too large (431) is in
//! `limits.rs`.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::security::raw_http;
use crate::support::helpers::{new_key, spawn_app, Answer, TestApp};

/// A raw answer: the status, the head's lines and the problem in the body, checked to be
/// problem+json whose `Content-Length` frames it exactly.
#[track_caller]
pub fn problem(raw: &str, status: u16, code: &str) -> Value {
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no complete head: {raw:?}"));
    assert!(head.starts_with(&format!("HTTP/1.1 {status} ")), "{raw}");
    let header = |name: &str| {
        head.lines()
            .find_map(|l| l.split_once(':').filter(|(n, _)| n.eq_ignore_ascii_case(name)))
            .map(|(_, v)| v.trim().to_owned())
    };
    assert_eq!(
        header("content-type").as_deref(),
        Some("application/problem+json"),
        "{raw}"
    );
    assert_eq!(header("content-length"), Some(body.len().to_string()), "{raw}");
    assert_eq!(header("connection").as_deref(), Some("close"), "{raw}");
    let problem: Value = serde_json::from_str(body).unwrap_or_else(|_| panic!("not JSON: {body:?}"));
    assert_eq!(problem["code"], code, "{raw}");
    assert_eq!(problem["status"], status, "{raw}");
    for field in ["type", "title", "detail"] {
        assert!(problem[field].is_string(), "problem without `{field}`: {raw}");
    }
    problem
}

async fn still_serving(app: &TestApp) {
    let health = Answer::from(app.client.get(app.url("/healthz")).send().await.unwrap()).await;
    assert_eq!(health.status, 200);
}

#[tokio::test]
async fn malformed_framing_is_a_400_invalid_request_problem() {
    let app = spawn_app().await;
    let head = format!(
        "POST /payments HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nIdempotency-Key: {}\r\n\
         Content-Type: application/json\r\n",
        app.api_key,
        new_key()
    );
    for framing in [
        "Content-Length: abc\r\n\r\n{}",
        "Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        "Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
        "Content-Length: -1\r\n\r\n{}",
        "Bad Header Line\r\n\r\n{}",
    ] {
        let answer = raw_http(&app, format!("{head}{framing}").into_bytes(), Duration::from_secs(5)).await;
        problem(&answer, 400, "invalid_request");
    }
    let answer = raw_http(&app, b"GET /healthz HTTP/9.9\r\n\r\n".to_vec(), Duration::from_secs(5)).await;
    problem(&answer, 400, "invalid_request");

    still_serving(&app).await;
    assert_eq!(app.payment_count().await, 0);
    // Found from outside: such answers showed in no metric (nor, at `warn`, in any log).
    assert_eq!(rejected(&app, "invalid_request"), 6, "each counted");
}

/// `oncepay_requests_rejected_total{code}` of the app.
pub fn rejected(app: &TestApp, code: &str) -> u64 {
    app.state.metrics.connections.rejected.with_label_values(&[code]).get()
}

/// A URL longer than 65,534 bytes (the `http` crate's limit on a URI) cannot be parsed: its
/// 400 says so, where it used to call a well-formed request not valid HTTP/1.1. One byte
/// shorter, the same request reaches the routes (401 without a key).
#[tokio::test]
async fn a_url_over_65534_bytes_is_a_400_that_names_the_limit() {
    let app = spawn_app().await;
    let request = |uri_len: usize| {
        let uri = format!("/payments?{}", "a".repeat(uri_len - "/payments?".len()));
        format!("GET {uri} HTTP/1.1\r\nHost: x\r\n\r\n").into_bytes()
    };
    let answer = raw_http(&app, request(65_535), Duration::from_secs(5)).await;
    let refused = problem(&answer, 400, "invalid_request");
    assert!(
        refused["detail"].as_str().unwrap().contains("65,534 bytes"),
        "{refused}"
    );
    let answer = raw_http(&app, request(65_534), Duration::from_secs(5)).await;
    assert!(
        answer.starts_with("HTTP/1.1 401 "),
        "{}",
        &answer[..answer.len().min(300)]
    );
    still_serving(&app).await;
}

/// A head that stalls is answered when the client request timeout (5 s) runs out.
#[tokio::test]
async fn a_head_that_does_not_arrive_is_a_408_request_timeout_problem() {
    let app = spawn_app().await;
    let started = Instant::now();

    let answer = raw_http(
        &app,
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n".to_vec(),
        Duration::from_secs(10),
    )
    .await;

    problem(&answer, 408, "request_timeout");
    assert_eq!(rejected(&app, "request_timeout"), 1, "a slowloris's head counted");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(4) && waited < Duration::from_secs(9),
        "{waited:?}"
    );
}

/// On a keep-alive connection, the answers before the bad request stay as they were; the
/// bad one is a problem and ends the connection.
#[tokio::test]
async fn a_bad_request_after_good_ones_on_one_connection_is_a_problem_too() {
    let app = spawn_app().await;
    let request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n\
                    GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n\
                    GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n"
        .to_vec();

    let answer = raw_http(&app, request, Duration::from_secs(5)).await;

    let ok = answer.find("HTTP/1.1 200 OK\r\n").expect("the first answer");
    let not_found = answer.find("HTTP/1.1 404 Not Found\r\n").expect("the second answer");
    let bad = answer.find("HTTP/1.1 400 Bad Request\r\n").expect("the third answer");
    assert!(ok < not_found && not_found < bad, "{answer}");
    assert!(answer[ok..not_found].ends_with(r#"{"status":"ok"}"#), "{answer}");
    assert!(answer[not_found..bad].contains(r#""code":"not_found""#), "{answer}");
    problem(&answer[bad..], 400, "invalid_request");
}

/// The one exception: a malformed chunk inside a chunked body. actix-http reports it as an
/// I/O error and drops the connection without any answer, as for a client that went away
/// (README, "Where oncepay departs from the contract"). Nothing is processed.
#[tokio::test]
async fn a_malformed_chunk_is_refused_or_dropped_and_processes_nothing() {
    let app = spawn_app().await;
    let request = format!(
        "POST /payments HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nIdempotency-Key: {}\r\n\
         Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{{}}\r\nzz\r\n",
        app.api_key,
        new_key()
    );

    let answer = raw_http(&app, request.into_bytes(), Duration::from_secs(5)).await;

    // Which comes first decides the answer: when the handler is already reading the body, the
    // broken chunk is its read error (a problem); otherwise actix-http drops the connection
    // with no answer (the exception the README documents). Never anything else.
    assert!(
        answer.is_empty()
            || (answer.starts_with("HTTP/1.1 400 ")
                && answer.contains("application/problem+json")
                && answer.contains("\"code\":\"invalid_json\"")),
        "neither silence nor a 400 problem: {answer}"
    );
    assert_eq!(app.payment_count().await, 0);
    assert_eq!(app.key_count().await, 0);
    still_serving(&app).await;
}
