//! A webhook receiver of the tests' own: a real HTTP/1.1 server on 127.0.0.1 that verifies
//! every signature with `oncepay_client::webhooks::verify` (written apart from the server's
//! signing code), records every message (its `webhook-id`, body, when it came and what it was
//! answered) and answers as the test scripts it: 2xx, another status (with `Retry-After`), or
//! a connection closed before any answer. It can be stopped and started again on its port
//! (the receiver down, then back). Shared by the API tests and the chaos tests.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// How the receiver answers one message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Status(u16),
    /// A status with `Retry-After: secs`.
    RetryAfter(u16, u64),
    /// Reads the whole request, then closes the connection without answering (the receiver
    /// may have processed it: the sender cannot know).
    Close,
    /// A status with this body, whatever its bytes.
    Body(u16, Vec<u8>),
    /// A status and a head announcing a body of 1000 bytes, of which it sends 3 and then
    /// nothing, the connection held open for 30 s.
    Stall(u16),
}

impl Reply {
    /// Whether the sender got a 2xx status (whatever followed it).
    pub fn is_success(&self) -> bool {
        match self {
            Self::Status(s) | Self::RetryAfter(s, _) | Self::Body(s, _) | Self::Stall(s) => (200..300).contains(s),
            Self::Close => false,
        }
    }
}

/// One message as received.
#[derive(Clone, Debug)]
pub struct Message {
    pub id: String,
    pub event_type: String,
    /// `data.id`: the resource.
    pub resource: String,
    pub body: Value,
    pub raw_body: Vec<u8>,
    pub headers: HashMap<String, String>,
    pub at: Instant,
    pub reply: Reply,
    /// 1 for the first message with this id, 2 for its first duplicate, ...
    pub nth: usize,
}

type Script = Box<dyn FnMut(&Message) -> Reply + Send>;

struct Inner {
    /// The path this receiver's endpoints post to, unique to it: a request for another path
    /// is a stranger's (see [`Receiver::url`]).
    path: String,
    secret: Option<String>,
    script: Script,
    messages: Vec<Message>,
    bad_signatures: Vec<String>,
    in_flight: usize,
    max_in_flight: usize,
    /// How long each answer takes (a slow receiver).
    delay: Duration,
}

#[derive(Clone)]
pub struct Receiver {
    pub port: u16,
    inner: Arc<Mutex<Inner>>,
    task: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl Receiver {
    /// Starts on a free port, answering 200 to everything.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let receiver = Self {
            port,
            inner: Arc::new(Mutex::new(Inner {
                path: format!("/hooks/{}", uuid::Uuid::new_v4().simple()),
                secret: None,
                script: Box::new(|_| Reply::Status(200)),
                messages: Vec::new(),
                bad_signatures: Vec::new(),
                in_flight: 0,
                max_in_flight: 0,
                delay: Duration::ZERO,
            })),
            task: Arc::new(Mutex::new(None)),
        };
        receiver.serve(listener);
        receiver
    }

    /// A free port on which nothing listens yet (`start_again` brings the receiver there).
    pub async fn unstarted() -> Self {
        let receiver = Self::start().await;
        receiver.stop();
        receiver
    }

    /// Its endpoints' URL. The path is the receiver's own: tests share one database, where
    /// the endpoints of finished tests stay, and a deliverer retrying one of their events
    /// reaches whatever listens on its port now. A port the kernel gives out again (CI saw
    /// a `top_up.refund_failed` of another test arrive here) must not make that event this
    /// receiver's: a request for another path is answered 404 and not recorded.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}{}", self.port, self.inner.lock().unwrap().path)
    }

    /// The endpoint's secret, which every signature must verify with.
    pub fn set_secret(&self, secret: &str) {
        self.inner.lock().unwrap().secret = Some(secret.to_owned());
    }

    /// Every answer waits `delay` first.
    pub fn set_delay(&self, delay: Duration) {
        self.inner.lock().unwrap().delay = delay;
    }

    pub fn script(&self, script: impl FnMut(&Message) -> Reply + Send + 'static) {
        self.inner.lock().unwrap().script = Box::new(script);
    }

    /// Stops listening (connections are refused); open connections are dropped.
    pub fn stop(&self) {
        if let Some(task) = self.task.lock().unwrap().take() {
            task.abort();
        }
    }

    /// Listens again on the same port.
    pub async fn start_again(&self) {
        let listener = loop {
            match TcpListener::bind(("127.0.0.1", self.port)).await {
                Ok(l) => break l,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        self.serve(listener);
    }

    fn serve(&self, listener: TcpListener) {
        let inner = self.inner.clone();
        let task = tokio::spawn(async move {
            let mut connections = Vec::new();
            let _guard = AbortAll(&mut connections);
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let inner = inner.clone();
                _guard.0.push(tokio::spawn(async move {
                    let _ = connection(stream, inner).await;
                }));
            }
        });
        *self.task.lock().unwrap() = Some(task);
    }

    pub fn messages(&self) -> Vec<Message> {
        self.inner.lock().unwrap().messages.clone()
    }

    /// The ids answered with a 2xx.
    pub fn acknowledged(&self) -> HashSet<String> {
        self.messages()
            .into_iter()
            .filter(|m| m.reply.is_success())
            .map(|m| m.id)
            .collect()
    }

    /// Writes every message with the endpoint's secret, as `scripts/standardwebhooks-verify.sh`
    /// reads them (the reference verifier, in Python); gives how many.
    pub fn write_for_reference_verifier(&self, path: &std::path::Path) -> usize {
        use base64::Engine as _;
        let inner = self.inner.lock().unwrap();
        let secret = inner.secret.clone().expect("the endpoint's secret is set");
        let messages: Vec<Value> = inner
            .messages
            .iter()
            .map(|m| {
                serde_json::json!({
                    "secret": secret,
                    "headers": {
                        "webhook-id": m.headers["webhook-id"],
                        "webhook-timestamp": m.headers["webhook-timestamp"],
                        "webhook-signature": m.headers["webhook-signature"],
                    },
                    "body_base64": base64::engine::general_purpose::STANDARD.encode(&m.raw_body),
                })
            })
            .collect();
        std::fs::write(path, serde_json::to_vec(&messages).unwrap()).unwrap();
        messages.len()
    }

    /// Requests read and not yet answered, now.
    pub fn in_flight(&self) -> usize {
        self.inner.lock().unwrap().in_flight
    }

    pub fn max_in_flight(&self) -> usize {
        self.inner.lock().unwrap().max_in_flight
    }

    /// Waits until `n` distinct ids were acknowledged, or panics after `timeout`.
    pub async fn wait_for_acknowledged(&self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let got = self.acknowledged().len();
            if got >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "only {got} of {n} events acknowledged within {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The checks every scenario makes of what arrived:
    /// - every signature verified;
    /// - one `webhook-id` per (type, resource): a duplicate carries the same id, and the
    ///   same body;
    /// - per resource, the events came in the order `expected` lists them, each first sent
    ///   only after the previous one was acknowledged.
    ///
    /// `expected` maps each resource to its event types in order; every one of them must be
    /// acknowledged, and nothing else may have arrived (no event of a rolled-back change).
    pub fn check(&self, expected: &BTreeMap<String, Vec<&str>>) -> Report {
        let inner = self.inner.lock().unwrap();
        assert!(
            inner.bad_signatures.is_empty(),
            "signatures that did not verify: {:?}",
            inner.bad_signatures
        );
        let mut ids: HashMap<(String, String), String> = HashMap::new();
        let mut bodies: HashMap<String, Vec<u8>> = HashMap::new();
        for m in &inner.messages {
            let id = ids
                .entry((m.event_type.clone(), m.resource.clone()))
                .or_insert_with(|| m.id.clone());
            assert_eq!(id, &m.id, "two webhook-ids for {} of {}", m.event_type, m.resource);
            let body = bodies.entry(m.id.clone()).or_insert_with(|| m.raw_body.clone());
            assert_eq!(body, &m.raw_body, "a duplicate of {} with another body", m.id);
        }
        for (resource, types) in expected {
            let mut previous_ack: Option<Instant> = None;
            for event_type in types {
                let of_event: Vec<&Message> = inner
                    .messages
                    .iter()
                    .filter(|m| &m.resource == resource && m.event_type == *event_type)
                    .collect();
                let first = of_event
                    .first()
                    .unwrap_or_else(|| panic!("{event_type} of {resource} never arrived"));
                let ack = of_event
                    .iter()
                    .find(|m| m.reply.is_success())
                    .unwrap_or_else(|| panic!("{event_type} of {resource} never acknowledged"));
                if let Some(previous) = previous_ack {
                    assert!(
                        first.at >= previous,
                        "{event_type} of {resource} sent before the previous event was acknowledged"
                    );
                }
                previous_ack = Some(ack.at);
            }
        }
        let expected_pairs: HashSet<(String, String)> = expected
            .iter()
            .flat_map(|(r, types)| types.iter().map(move |t| (t.to_string(), r.clone())))
            .collect();
        for m in &inner.messages {
            assert!(
                expected_pairs.contains(&(m.event_type.clone(), m.resource.clone())),
                "an event nobody committed arrived: {} of {}",
                m.event_type,
                m.resource
            );
        }
        Report {
            messages: inner.messages.len(),
            events: ids.len(),
            duplicates: inner.messages.len() - bodies.len(),
        }
    }
}

/// What [`Receiver::check`] counted.
#[derive(Debug)]
pub struct Report {
    pub messages: usize,
    pub events: usize,
    /// Messages that repeated an id already received.
    pub duplicates: usize,
}

struct AbortAll<'a>(&'a mut Vec<JoinHandle<()>>);

impl Drop for AbortAll<'_> {
    fn drop(&mut self) {
        for task in self.0.iter() {
            task.abort();
        }
    }
}

struct InFlight(Arc<Mutex<Inner>>);

impl InFlight {
    fn new(inner: &Arc<Mutex<Inner>>) -> Self {
        let mut guard = inner.lock().unwrap();
        guard.in_flight += 1;
        guard.max_in_flight = guard.max_in_flight.max(guard.in_flight);
        drop(guard);
        Self(inner.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.lock().unwrap().in_flight -= 1;
    }
}

/// Serves one keep-alive connection.
async fn connection(mut stream: TcpStream, inner: Arc<Mutex<Inner>>) -> std::io::Result<()> {
    let mut buffer = Vec::new();
    loop {
        // The head.
        let (head_len, headers, content_length, path) = loop {
            let mut parsed_headers = [httparse::EMPTY_HEADER; 32];
            let mut request = httparse::Request::new(&mut parsed_headers);
            if let Ok(httparse::Status::Complete(len)) = request.parse(&buffer) {
                let path = request.path.unwrap_or_default().to_owned();
                let headers: HashMap<String, String> = request
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_ascii_lowercase(),
                            String::from_utf8_lossy(h.value).into_owned(),
                        )
                    })
                    .collect();
                let content_length = headers
                    .get("content-length")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0usize);
                break (len, headers, content_length, path);
            }
            let mut chunk = [0u8; 8192];
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buffer.extend_from_slice(&chunk[..n]);
        };
        let _in_flight = InFlight::new(&inner);
        while buffer.len() < head_len + content_length {
            let mut chunk = [0u8; 8192];
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buffer.extend_from_slice(&chunk[..n]);
        }
        let body: Vec<u8> = buffer[head_len..head_len + content_length].to_vec();
        buffer.drain(..head_len + content_length);
        if path != inner.lock().unwrap().path {
            stream
                .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                .await?;
            continue;
        }
        let delay = inner.lock().unwrap().delay;
        tokio::time::sleep(delay).await;
        let reply = {
            let mut guard = inner.lock().unwrap();
            let header = |name: &str| headers.get(name).cloned().unwrap_or_default();
            let id = header("webhook-id");
            if let Some(secret) = &guard.secret {
                if let Err(err) = oncepay_client::webhooks::verify(
                    secret,
                    &id,
                    &header("webhook-timestamp"),
                    &header("webhook-signature"),
                    &body,
                ) {
                    guard.bad_signatures.push(format!("{id}: {err}"));
                }
            }
            let parsed: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let nth = guard.messages.iter().filter(|m| m.id == id).count() + 1;
            let mut message = Message {
                id,
                event_type: parsed["type"].as_str().unwrap_or_default().to_owned(),
                resource: parsed["data"]["id"].as_str().unwrap_or_default().to_owned(),
                body: parsed,
                raw_body: body,
                headers,
                at: Instant::now(),
                reply: Reply::Status(200),
                nth,
            };
            message.reply = (guard.script)(&message);
            let reply = message.reply.clone();
            guard.messages.push(message);
            reply
        };
        let (status, retry_after, body) = match reply {
            Reply::Close => {
                stream.shutdown().await?;
                return Ok(());
            }
            Reply::Stall(status) => {
                let head =
                    format!("HTTP/1.1 {status} X\r\ncontent-length: 1000\r\ncontent-type: text/plain\r\n\r\nabc");
                stream.write_all(head.as_bytes()).await?;
                tokio::time::sleep(Duration::from_secs(30)).await;
                return Ok(());
            }
            Reply::Status(status) => (status, None, b"ok".to_vec()),
            Reply::RetryAfter(status, secs) => (status, Some(secs), b"ok".to_vec()),
            Reply::Body(status, body) => (status, None, body),
        };
        let mut answer = format!(
            "HTTP/1.1 {status} X\r\ncontent-length: {}\r\ncontent-type: text/plain\r\n",
            body.len()
        );
        if let Some(secs) = retry_after {
            answer.push_str(&format!("retry-after: {secs}\r\n"));
        }
        answer.push_str("\r\n");
        let mut answer = answer.into_bytes();
        answer.extend_from_slice(&body);
        stream.write_all(&answer).await?;
    }
}
