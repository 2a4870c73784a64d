//! A fault-injecting HTTP/1.1 proxy, real TCP on 127.0.0.1 between a client and a real
//! server. For each request a plan decides: forward it, forward it and lose the answer
//! (processed, answer never delivered), forward it and hold the answer past the client's
//! timeout, or answer locally (a 503 window, a brownout). Every request is logged with its
//! arrival time, key and body, so tests measure what the client really sent.
//!
//! One request per connection: the proxy asks the server for `Connection: close`, passes
//! its answer on (which says so too) and closes, so no answer can leak to another request.
//!
//! In front of localstripe, `start_stripe` adds Stripe's rules that localstripe lacks
//! (`crate::stripe_rules`): they answer first, whatever the plan, as Stripe would.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

use crate::stripe_rules::{stripe_answer, StripeRules};

const MAX_REQUEST_BYTES: usize = 1 << 20;
const IO_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Forward,
    /// Forward, read the server's whole answer, then close the client's connection without it.
    DropAnswer,
    /// Forward, then hold the server's answer this long before sending it.
    DelayAnswer(Duration),
    /// Answer without forwarding: a problem+json with this status and `code`, and
    /// `Retry-After` when given.
    Problem {
        status: u16,
        code: &'static str,
        retry_after_secs: Option<u64>,
    },
    /// Answer without forwarding, as a load balancer with no healthy upstream does.
    PlainError {
        status: u16,
    },
    /// Close the client's connection without forwarding or answering (a refused call).
    Refuse,
    /// Hold the request this long, then forward it and pass the answer on (to a client that
    /// may have given up on it).
    HoldRequest(Duration),
    /// Read the request and never forward or answer it (until the proxy is dropped).
    Swallow,
    /// Forward, read the server's whole answer, and answer this status instead (a 5xx after
    /// the server acted).
    ForwardThenStatus(u16),
    /// Answer Stripe's own 500 (`api_error`) without forwarding: Stripe began to execute the
    /// call and failed before it acted (saved under the key by the Stripe rules).
    ServerError,
    /// Answer Stripe's refusal of the call without forwarding: `status` and an error object
    /// of this `type` and `code`.
    StripeError {
        status: u16,
        kind: &'static str,
        code: &'static str,
    },
    /// Answered by the named Stripe rule (`crate::stripe_rules`), never by the plan.
    Stripe(&'static str),
    /// Forward, then pass on the server's head without its `Content-Length` and half of its
    /// body, and close: a success cut short, framed by the close.
    ForwardThenCutBody,
    /// Forward, read the server's whole answer, and answer a 308 to this `Location` instead
    /// (a proxy that moved the API and passed the request on all the same).
    ForwardThenRedirect(&'static str),
    /// Answer without forwarding: `status` with this plain-text body.
    PlainBody {
        status: u16,
        body: &'static str,
    },
}

/// What the plan sees of a request.
pub struct Incoming {
    /// Arrival order, from 0.
    pub index: usize,
    /// Time since the proxy started.
    pub elapsed: Duration,
    pub method: String,
    pub path: String,
}

/// One request as the proxy saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    /// When the whole request had arrived, since the proxy started.
    pub at: Duration,
    pub path: String,
    pub key: Option<String>,
    /// Its `Stripe-Version` header.
    pub stripe_version: Option<String>,
    pub body: Vec<u8>,
    pub action: Action,
    /// The status the server (or the proxy) answered; `None` when the server gave none.
    pub status: Option<u16>,
}

/// A plan: the first request is processed and its answer lost, every later one forwarded.
pub fn lose_the_first_answer(incoming: &Incoming) -> Action {
    if incoming.index == 0 {
        Action::DropAnswer
    } else {
        Action::Forward
    }
}

/// A plan: `first` for the first request, `rest` for every later one.
pub fn first_then(first: Action, rest: Action) -> impl Fn(&Incoming) -> Action + Send + Sync + 'static {
    move |incoming| {
        if incoming.index == 0 {
            first.clone()
        } else {
            rest.clone()
        }
    }
}

type Plan = dyn Fn(&Incoming) -> Action + Send + Sync;

pub struct FaultProxy {
    /// The base URL clients use instead of the server's.
    pub url: String,
    log: Arc<Mutex<Vec<Seen>>>,
    arrived: Arc<Mutex<Vec<(String, String)>>>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy in front of `upstream` (`http://127.0.0.1:PORT`).
    pub async fn start(upstream: &str, plan: impl Fn(&Incoming) -> Action + Send + Sync + 'static) -> Self {
        Self::start_with(upstream, None, plan).await
    }

    /// Starts a proxy in front of localstripe at `upstream` that answers by Stripe's `rules`
    /// first.
    pub async fn start_stripe(
        upstream: &str,
        rules: StripeRules,
        plan: impl Fn(&Incoming) -> Action + Send + Sync + 'static,
    ) -> Self {
        Self::start_with(upstream, Some(rules), plan).await
    }

    async fn start_with(
        upstream: &str,
        rules: Option<StripeRules>,
        plan: impl Fn(&Incoming) -> Action + Send + Sync + 'static,
    ) -> Self {
        let upstream = upstream
            .strip_prefix("http://")
            .expect("an http:// upstream")
            .to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("the proxy binds");
        let url = format!("http://{}", listener.local_addr().unwrap());
        let log = Arc::new(Mutex::new(Vec::new()));
        let arrived = Arc::new(Mutex::new(Vec::new()));
        let shared = Shared {
            upstream,
            rules,
            plan: Box::new(plan),
            log: log.clone(),
            arrived: arrived.clone(),
            started: Instant::now(),
            count: Mutex::new(0),
        };
        let accept = tokio::spawn(accept_loop(listener, Arc::new(shared)));
        Self {
            url,
            log,
            arrived,
            accept,
        }
    }

    /// Every request that has arrived so far (method, path), before any action on it.
    pub fn arrived(&self) -> Vec<(String, String)> {
        self.arrived.lock().unwrap().clone()
    }

    /// Every request so far, in arrival order.
    pub fn seen(&self) -> Vec<Seen> {
        let mut seen = self.log.lock().unwrap().clone();
        seen.sort_by_key(|s| s.at);
        seen
    }
}

impl Drop for FaultProxy {
    /// Stops accepting; dropping the accept task's `JoinSet` aborts every open connection.
    fn drop(&mut self) {
        self.accept.abort();
    }
}

struct Shared {
    upstream: String,
    rules: Option<StripeRules>,
    plan: Box<Plan>,
    log: Arc<Mutex<Vec<Seen>>>,
    arrived: Arc<Mutex<Vec<(String, String)>>>,
    started: Instant,
    count: Mutex<usize>,
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let shared = shared.clone();
        connections.spawn(async move {
            // A failed connection is the client's or the test's business, not the proxy's.
            let _ = tokio::time::timeout(IO_TIMEOUT, serve(stream, &shared)).await;
        });
        // Reap finished connections so the set stays small over long runs.
        while connections.try_join_next().is_some() {}
    }
}

async fn serve(mut client: TcpStream, shared: &Shared) -> std::io::Result<()> {
    let Some(request) = read_request(&mut client).await? else {
        return Ok(());
    };
    let at = shared.started.elapsed();
    let index = {
        let mut count = shared.count.lock().unwrap();
        *count += 1;
        *count - 1
    };
    shared
        .arrived
        .lock()
        .unwrap()
        .push((request.method.clone(), request.path.clone()));
    if let Some(rules) = &shared.rules {
        if let Some((rule, answer)) = rules.before(&request, &shared.upstream).await {
            shared.log.lock().unwrap().push(Seen {
                at,
                path: request.path.clone(),
                key: request.key.clone(),
                stripe_version: request.header("stripe-version"),
                body: request.body.clone(),
                action: Action::Stripe(rule),
                status: status_of(&answer),
            });
            return client.write_all(&answer).await;
        }
    }
    let action = (shared.plan)(&Incoming {
        index,
        elapsed: at,
        method: request.method.clone(),
        path: request.path.clone(),
    });
    let unanswered = || Seen {
        at,
        path: request.path.clone(),
        key: request.key.clone(),
        stripe_version: request.header("stripe-version"),
        body: request.body.clone(),
        action: action.clone(),
        status: None,
    };
    match &action {
        Action::Refuse => {
            shared.log.lock().unwrap().push(unanswered());
            return Ok(());
        }
        Action::Swallow => {
            shared.log.lock().unwrap().push(unanswered());
            tokio::time::sleep(IO_TIMEOUT * 2).await;
            return Ok(());
        }
        Action::HoldRequest(delay) => tokio::time::sleep(*delay).await,
        _ => {}
    }
    let answer = match &action {
        Action::Problem {
            status,
            code,
            retry_after_secs,
        } => Some(problem(*status, code, *retry_after_secs)),
        Action::PlainError { status } => Some(plain_error(*status)),
        Action::PlainBody { status, body } => Some(plain_body(*status, body)),
        Action::ForwardThenCutBody => forward(&shared.upstream, &request).await.ok().map(cut_body),
        Action::ForwardThenStatus(status) => {
            if let Ok(answer) = forward(&shared.upstream, &request).await {
                // Seen by the rules (what localstripe made), then lost to the 5xx.
                if let Some(rules) = &shared.rules {
                    rules.observe(&request, closing(answer));
                }
            }
            Some(plain_error(*status))
        }
        Action::ForwardThenRedirect(location) => {
            let _ = forward(&shared.upstream, &request).await;
            Some(
                format!("HTTP/1.1 308 Permanent Redirect\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    .into_bytes(),
            )
        }
        Action::ServerError => Some(stripe_answer(
            500,
            &serde_json::json!({"error": {"type": "api_error", "message": "An unknown error occurred"}}),
        )),
        Action::StripeError { status, kind, code } => Some(stripe_answer(
            *status,
            &serde_json::json!({"error": {"type": kind, "code": code, "message": "injected by the test proxy"}}),
        )),
        Action::Refuse | Action::Swallow | Action::Stripe(_) => None,
        Action::Forward | Action::DropAnswer | Action::DelayAnswer(_) | Action::HoldRequest(_) => {
            let answer = forward(&shared.upstream, &request).await.ok().map(closing);
            match (&shared.rules, answer) {
                (Some(rules), Some(answer)) => Some(rules.observe(&request, answer)),
                (_, answer) => answer,
            }
        }
    };
    let status = answer.as_deref().and_then(status_of);
    if let (Some(rules), Some(answer)) = (&shared.rules, &answer) {
        rules.settle(&request, &action, status, answer);
    }
    shared.log.lock().unwrap().push(Seen {
        at,
        path: request.path.clone(),
        key: request.key.clone(),
        stripe_version: request.header("stripe-version"),
        body: request.body.clone(),
        action: action.clone(),
        status,
    });
    let Some(answer) = answer else {
        return Ok(());
    };
    match action {
        Action::DropAnswer => Ok(()),
        Action::DelayAnswer(delay) => {
            tokio::time::sleep(delay).await;
            client.write_all(&answer).await
        }
        _ => client.write_all(&answer).await,
    }
}

pub struct Request {
    pub method: String,
    pub path: String,
    pub key: Option<String>,
    /// Header lines other than `Connection`, each with its CRLF.
    pub headers: Vec<u8>,
    pub body: Vec<u8>,
}

impl Request {
    /// The value of the header `name` (lower case), if it was sent.
    pub fn header(&self, name: &str) -> Option<String> {
        String::from_utf8_lossy(&self.headers).split("\r\n").find_map(|line| {
            let (header, value) = line.split_once(':')?;
            header.eq_ignore_ascii_case(name).then(|| value.trim().to_owned())
        })
    }
}

/// Reads one request (head and `Content-Length` body); `None` when the client closed first.
async fn read_request(stream: &mut TcpStream) -> std::io::Result<Option<Request>> {
    let mut buffer = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        let read = stream.read(&mut chunk).await?;
        if read == 0 {
            return Ok(None);
        }
        buffer.extend_from_slice(&chunk[..read]);
        if buffer.len() > MAX_REQUEST_BYTES {
            return Err(std::io::Error::other("request too large for the test proxy"));
        }
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut parsed = httparse::Request::new(&mut headers);
        let httparse::Status::Complete(head_len) = parsed.parse(&buffer).map_err(std::io::Error::other)? else {
            continue;
        };
        let mut request = Request {
            method: parsed.method.unwrap_or_default().to_owned(),
            path: parsed.path.unwrap_or_default().to_owned(),
            key: None,
            headers: Vec::new(),
            body: Vec::new(),
        };
        let mut body_len = 0;
        for header in parsed.headers.iter() {
            let value = String::from_utf8_lossy(header.value).into_owned();
            if header.name.eq_ignore_ascii_case("content-length") {
                body_len = value.trim().parse().map_err(std::io::Error::other)?;
            } else if header.name.eq_ignore_ascii_case("idempotency-key") {
                request.key = Some(value.clone());
            } else if header.name.eq_ignore_ascii_case("transfer-encoding") {
                return Err(std::io::Error::other("the test proxy reads Content-Length bodies only"));
            }
            if !header.name.eq_ignore_ascii_case("connection") {
                request
                    .headers
                    .extend_from_slice(format!("{}: {value}\r\n", header.name).as_bytes());
            }
        }
        while buffer.len() < head_len + body_len {
            let read = stream.read(&mut chunk).await?;
            if read == 0 {
                return Ok(None);
            }
            buffer.extend_from_slice(&chunk[..read]);
        }
        request.body = buffer[head_len..head_len + body_len].to_vec();
        return Ok(Some(request));
    }
}

/// Sends the request to the server on a new connection and reads its whole answer.
pub async fn forward(upstream: &str, request: &Request) -> std::io::Result<Vec<u8>> {
    let mut server = TcpStream::connect(upstream).await?;
    let mut bytes = format!("{} {} HTTP/1.1\r\n", request.method, request.path).into_bytes();
    bytes.extend_from_slice(&request.headers);
    bytes.extend_from_slice(b"Connection: close\r\n\r\n");
    bytes.extend_from_slice(&request.body);
    server.write_all(&bytes).await?;
    let mut answer = Vec::new();
    server.read_to_end(&mut answer).await?;
    Ok(answer)
}

/// The answer with `Connection: close` in its head, whatever the server said (localstripe
/// says keep-alive): a client must not pool a connection this proxy is about to close, or
/// its next request would meet a closed connection and be retried by the client's HTTP
/// stack, not by the code under test.
fn closing(answer: Vec<u8>) -> Vec<u8> {
    reheaded(answer, &["connection:"], |body| body)
}

/// `answer` with the head lines starting with one of `dropped` (lowercase) taken out and
/// `Connection: close` added, its body as `body` makes it.
fn reheaded(answer: Vec<u8>, dropped: &[&str], body: impl FnOnce(&[u8]) -> &[u8]) -> Vec<u8> {
    let Some(end) = answer.windows(4).position(|w| w == b"\r\n\r\n") else {
        return answer;
    };
    let head = String::from_utf8_lossy(&answer[..end]).into_owned();
    let mut lines: Vec<&str> = head
        .split("\r\n")
        .filter(|line| {
            let line = line.to_ascii_lowercase();
            !dropped.iter().any(|d| line.starts_with(d))
        })
        .collect();
    lines.push("Connection: close");
    let mut closed = lines.join("\r\n").into_bytes();
    closed.extend_from_slice(b"\r\n\r\n");
    closed.extend_from_slice(body(&answer[end + 4..]));
    closed
}

fn status_of(answer: &[u8]) -> Option<u16> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut response = httparse::Response::new(&mut headers);
    response.parse(answer).ok()?;
    response.code
}

fn problem(status: u16, code: &str, retry_after_secs: Option<u64>) -> Vec<u8> {
    let body = serde_json::json!({
        "type": format!("https://oncepay.dev/problems/{code}"),
        "title": code,
        "status": status,
        "detail": "injected by the test proxy",
        "code": code,
    })
    .to_string();
    let retry_after = retry_after_secs
        .map(|s| format!("Retry-After: {s}\r\n"))
        .unwrap_or_default();
    format!(
        "HTTP/1.1 {status} Injected\r\nContent-Type: application/problem+json\r\n{retry_after}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn plain_error(status: u16) -> Vec<u8> {
    plain_body(status, "no healthy upstream")
}

fn plain_body(status: u16, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status} Injected\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The answer's head without `Content-Length` (the close frames it) and half of its body.
fn cut_body(answer: Vec<u8>) -> Vec<u8> {
    reheaded(answer, &["connection:", "content-length:"], |body| {
        &body[..body.len() / 2]
    })
}
