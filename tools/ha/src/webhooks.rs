//! The webhook side of `make ha`: a receiver on 127.0.0.1 (in the hub namespace, where the
//! three oncepay instances run) registered as the tenant's endpoint before the load starts.
//! It verifies every signature with `oncepay_client::webhooks::verify` and records every
//! `webhook-id` with its event's type and resource. After the faults, the books check that
//! every acknowledged payment's `payment.succeeded` arrived (and every acknowledged refund's
//! `payment.refunded`), each event under one id, duplicates (same id) counted.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use oncepay_client::{Client, IdempotencyKey};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::load::{Journal, Kind};

#[derive(Default)]
struct Seen {
    /// (type, resource) -> the webhook-ids it came with.
    ids: HashMap<(String, String), HashSet<String>>,
    messages: u64,
    bad_signatures: u64,
}

#[derive(Clone)]
pub struct Receiver {
    pub url: String,
    secret: Arc<Mutex<Option<String>>>,
    seen: Arc<Mutex<Seen>>,
}

/// What the webhook check found.
pub struct Verdict {
    /// Acknowledged payments (and refunds) whose event never arrived.
    pub missing: u64,
    /// Events that arrived under two different webhook-ids.
    pub split_ids: u64,
    pub bad_signatures: u64,
    pub messages: u64,
    pub events: u64,
}

impl Receiver {
    pub async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/oncepay-ha", listener.local_addr()?);
        let receiver = Self {
            url,
            secret: Arc::default(),
            seen: Arc::default(),
        };
        let this = receiver.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let this = this.clone();
                tokio::spawn(async move {
                    let _ = this.serve(stream).await;
                });
            }
        });
        Ok(receiver)
    }

    /// Registers this receiver as the tenant's endpoint (every event type).
    pub async fn subscribe(&self, client: &Client) -> anyhow::Result<()> {
        let key = IdempotencyKey::generate();
        let endpoint = client
            .create_webhook_endpoint(&self.url, None, &key)
            .await
            .context("registering the webhook endpoint")?;
        *self.secret.lock().expect("not poisoned") = endpoint.value.secret;
        Ok(())
    }

    async fn serve(&self, mut stream: TcpStream) -> std::io::Result<()> {
        let mut buffer: Vec<u8> = Vec::new();
        let mut chunk = [0u8; 8192];
        loop {
            let head_end = loop {
                if let Some(i) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
                let n = stream.read(&mut chunk).await?;
                if n == 0 {
                    return Ok(());
                }
                buffer.extend_from_slice(&chunk[..n]);
            };
            let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
            let header = |name: &str| {
                head.lines()
                    .find_map(|l| {
                        let (n, v) = l.split_once(':')?;
                        n.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
                    })
                    .unwrap_or_default()
            };
            let length: usize = header("content-length").parse().unwrap_or(0);
            while buffer.len() < head_end + length {
                let n = stream.read(&mut chunk).await?;
                if n == 0 {
                    return Ok(());
                }
                buffer.extend_from_slice(&chunk[..n]);
            }
            let body: Vec<u8> = buffer[head_end..head_end + length].to_vec();
            buffer.drain(..head_end + length);
            let id = header("webhook-id");
            let secret = self.secret.lock().expect("not poisoned").clone().unwrap_or_default();
            let verified = oncepay_client::webhooks::verify(
                &secret,
                &id,
                &header("webhook-timestamp"),
                &header("webhook-signature"),
                &body,
            )
            .is_ok();
            let event: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            {
                let mut seen = self.seen.lock().expect("not poisoned");
                seen.messages += 1;
                if verified {
                    let key = (
                        event["type"].as_str().unwrap_or_default().to_owned(),
                        event["data"]["id"].as_str().unwrap_or_default().to_owned(),
                    );
                    seen.ids.entry(key).or_default().insert(id);
                } else {
                    seen.bad_signatures += 1;
                }
            }
            let answer: &[u8] = if verified {
                b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
            } else {
                b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n"
            };
            stream.write_all(answer).await?;
        }
    }

    /// Waits (up to `within`) until every acknowledged payment's and refund's event arrived,
    /// then counts what is missing.
    pub async fn check(&self, journal: &Journal, within: Duration) -> Verdict {
        let expected: Vec<(String, String)> = journal
            .acks()
            .into_iter()
            .filter_map(|a| match a.kind {
                Kind::Pay => Some(("payment.succeeded".to_owned(), a.resource)),
                Kind::Refund => Some(("payment.refunded".to_owned(), a.resource)),
                Kind::Open | Kind::Transfer => None,
            })
            .collect();
        let deadline = Instant::now() + within;
        loop {
            let missing = {
                let seen = self.seen.lock().expect("not poisoned");
                expected.iter().filter(|e| !seen.ids.contains_key(*e)).count() as u64
            };
            if missing == 0 || Instant::now() >= deadline {
                let seen = self.seen.lock().expect("not poisoned");
                return Verdict {
                    missing,
                    split_ids: seen.ids.values().filter(|ids| ids.len() > 1).count() as u64,
                    bad_signatures: seen.bad_signatures,
                    messages: seen.messages,
                    events: seen.ids.len() as u64,
                };
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}
