//! One client cannot hold every connection of a replica: past 80 % of
//! `ONCEPAY_MAX_CONNECTIONS` the idle keep-alive connections are closed first, never a
//! request under way, and `ONCEPAY_MAX_CONNECTIONS_PER_PEER` refuses one address's
//! connections past its cap at accept (`src/http1/connections.rs`). Raw TCP to the real
//! server.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio::time::timeout;

use crate::support::helpers::{metric_value, new_key, TestApp};

const HEALTH: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";
/// The longest any step here waits: well under the 30 s keep-alive, so that a connection seen
/// closed within it was closed by the pressure, not by its keep-alive running out.
const BOUND: Duration = Duration::from_secs(10);

/// A server of one worker whose process serves at most `max_connections`.
async fn app_with_limit(max_connections: usize) -> TestApp {
    TestApp::builder()
        .settings(|s| {
            s.workers = 1;
            s.max_connections = max_connections;
        })
        .spawn()
        .await
}

async fn connect(app: &TestApp) -> TcpStream {
    let address = app.address.trim_start_matches("http://");
    timeout(BOUND, TcpStream::connect(address))
        .await
        .expect("connected within the bound")
        .unwrap()
}

/// One answer read whole: its head and the `Content-Length` bytes of its body. `None` when
/// the connection ends first.
async fn read_answer(stream: &mut TcpStream) -> Option<String> {
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = answer.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&answer[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|line| line.strip_prefix("content-length:"))
                .map_or(0, |n| n.trim().parse().unwrap());
            if answer.len() >= end + 4 + length {
                return Some(String::from_utf8_lossy(&answer).into_owned());
            }
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => answer.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Sends `request` and reads its answer, within the bound.
async fn exchange(stream: &mut TcpStream, request: &[u8]) -> Option<String> {
    timeout(BOUND, async {
        stream.write_all(request).await.ok()?;
        read_answer(stream).await
    })
    .await
    .expect("an answer or the end of the connection within the bound")
}

/// A keep-alive connection that made one request, got its answer, and stays open.
async fn idle_connection(app: &TestApp) -> TcpStream {
    let mut stream = connect(app).await;
    let answer = exchange(&mut stream, HEALTH).await.expect("an answer");
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    stream
}

/// Whether the server closed the connection (end of stream or reset) within the bound.
async fn closed_by_server(mut stream: TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match timeout(BOUND, stream.read(&mut byte)).await {
        Ok(Ok(0) | Err(_)) => true,
        Ok(Ok(_)) => panic!("the server sent bytes nobody asked for"),
        Err(_) => false,
    }
}

/// A payment's head and body: the head announces the whole body.
fn payment(app: &TestApp, extra_header: &str) -> (String, String) {
    let body = r#"{"amount": 1}"#.to_owned();
    let head = format!(
        "POST /payments HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nIdempotency-Key: {}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n{extra_header}\r\n",
        app.api_key,
        new_key(),
        body.len()
    );
    (head, body)
}

/// The issue's attack, on every slot: a client opened as many keep-alive connections as the
/// process serves, made one request on each and keeps them open. Without the 80 % rule the
/// new client waits in the listen backlog until a keep-alive runs out (30 s).
#[tokio::test]
async fn idle_keep_alive_connections_on_every_slot_do_not_keep_a_new_client_waiting() {
    const LIMIT: usize = 40;
    let app = app_with_limit(LIMIT).await;
    let mut held = Vec::with_capacity(LIMIT);
    for _ in 0..LIMIT {
        held.push(idle_connection(&app).await);
    }

    let answer = timeout(Duration::from_secs(1), async {
        let mut client = connect(&app).await;
        client.write_all(HEALTH).await.unwrap();
        read_answer(&mut client).await
    })
    .await;

    assert!(
        matches!(&answer, Ok(Some(a)) if a.starts_with("HTTP/1.1 200 ")),
        "the new client was not answered within 1 s: {answer:?}"
    );
    // The room came from idle connections the server closed.
    let mut probes: JoinSet<bool> = held.into_iter().map(closed_by_server).collect();
    let mut closed = false;
    while let Some(probe) = probes.join_next().await {
        if probe.unwrap() {
            closed = true;
            break;
        }
    }
    assert!(closed, "no held connection was closed by the server");
}

/// Past 80 % of the limit the connections that finished an answer and sent nothing since are
/// closed; one whose request is under way (its head sent and its body not, or told to go on
/// with `100 Continue`) is not, and gets its answer.
#[tokio::test]
async fn past_80_percent_idle_connections_close_and_requests_under_way_are_answered() {
    let app = app_with_limit(10).await;
    // A keep-alive connection, idle once, now in its second request: the head and half the body.
    let mut midway = idle_connection(&app).await;
    let (head, body) = payment(&app, "");
    let (first_half, second_half) = body.split_at(body.len() / 2);
    midway
        .write_all(format!("{head}{first_half}").as_bytes())
        .await
        .unwrap();
    // A connection told to go on, that has not sent its body yet.
    let mut continued = connect(&app).await;
    let (continued_head, continued_body) = payment(&app, "Expect: 100-continue\r\n");
    continued.write_all(continued_head.as_bytes()).await.unwrap();
    let mut interim = [0u8; CONTINUE.len()];
    timeout(BOUND, continued.read_exact(&mut interim))
        .await
        .expect("100 Continue within the bound")
        .unwrap();
    assert_eq!(&interim[..], CONTINUE);
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(idle_connection(&app).await);
    }

    // Six open; the ninth is past 80 % of 10.
    let mut fresh = Vec::new();
    for _ in 0..3 {
        fresh.push(connect(&app).await);
    }

    for (i, stream) in idle.into_iter().enumerate() {
        assert!(closed_by_server(stream).await, "idle connection {i} still open");
    }
    let answer = exchange(&mut midway, second_half.as_bytes()).await;
    assert!(
        matches!(&answer, Some(a) if a.starts_with("HTTP/1.1 201 ")),
        "the request midway: {answer:?}"
    );
    let answer = exchange(&mut continued, continued_body.as_bytes()).await;
    assert!(
        matches!(&answer, Some(a) if a.starts_with("HTTP/1.1 201 ")),
        "the request told to go on: {answer:?}"
    );
    // The connections that pushed it past 80 % had sent nothing yet: not idle, still served.
    for stream in &mut fresh {
        let answer = exchange(stream, HEALTH).await;
        assert!(
            matches!(&answer, Some(a) if a.starts_with("HTTP/1.1 200 ")),
            "{answer:?}"
        );
    }
}

/// `GET /healthz` on a new connection: `None` when the connection is refused, reset or closed
/// (a reset can come before `connect` returns).
async fn health_on_a_new_connection(app: &TestApp) -> Option<String> {
    let address = app.address.trim_start_matches("http://");
    let mut stream = timeout(BOUND, TcpStream::connect(address))
        .await
        .expect("connected or refused within the bound")
        .ok()?;
    exchange(&mut stream, HEALTH).await
}

/// With a cap of 3 from one address (the tests connect from 127.0.0.1), the fourth
/// connection is closed unanswered while the three go on; once one of them closes, a new one
/// is taken.
#[tokio::test]
async fn a_connection_past_its_addresss_cap_is_closed_unanswered_and_the_others_go_on() {
    const CAP: usize = 3;
    let app = TestApp::builder()
        .settings(|s| s.max_connections_per_peer = CAP)
        .spawn()
        .await;
    let mut held = Vec::new();
    for _ in 0..CAP {
        held.push(idle_connection(&app).await);
    }

    let answer = health_on_a_new_connection(&app).await;

    assert_eq!(answer, None, "the connection past the cap was answered");
    for stream in &mut held {
        let answer = exchange(stream, HEALTH).await;
        assert!(
            matches!(&answer, Some(a) if a.starts_with("HTTP/1.1 200 ")),
            "{answer:?}"
        );
    }
    let refused = r#"oncepay_connections_refused_total{reason="per_peer"}"#;
    assert_eq!(metric_value(&app.metrics().await, refused), 1.0);

    drop(held.pop());
    // The server frees the slot when it reads the close, a moment later.
    let mut answered = false;
    for _ in 0..50 {
        if health_on_a_new_connection(&app)
            .await
            .is_some_and(|a| a.starts_with("HTTP/1.1 200 "))
        {
            answered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(answered, "no new connection was taken after one closed");
}
