//! A TCP relay on 127.0.0.1 that a test can cut or silence: a server built through it
//! reaches PostgreSQL until `cut`, and after it finds the port closed and its open
//! connections gone, as when the database host goes away; while `silenced`, every connection
//! stays open and nothing passes either way, as in a network partition (no reset, no
//! refusal: the bytes sent are taken, and no answer comes). The shared test cluster stays up.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::task::{JoinHandle, JoinSet};

/// How often a silenced relay looks whether it may pass its bytes on.
const SILENCE_POLL: Duration = Duration::from_millis(10);

pub struct TcpRelay {
    pub port: u16,
    accept: JoinHandle<()>,
    connections: Arc<Mutex<JoinSet<()>>>,
    silent: Arc<AtomicBool>,
}

impl TcpRelay {
    /// Relays every connection made to `127.0.0.1:port` to `upstream` (`host:port`).
    pub async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("the relay binds");
        let port = listener.local_addr().unwrap().port();
        let connections = Arc::new(Mutex::new(JoinSet::new()));
        let silent = Arc::new(AtomicBool::new(false));
        let relayed = connections.clone();
        let quiet = silent.clone();
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let quiet = quiet.clone();
                relayed.lock().await.spawn(async move {
                    if let Ok(outbound) = TcpStream::connect(&upstream).await {
                        let (from_client, to_client) = inbound.into_split();
                        let (from_server, to_server) = outbound.into_split();
                        tokio::join!(
                            pump(from_client, to_server, &quiet),
                            pump(from_server, to_client, &quiet)
                        );
                    }
                });
            }
        });
        Self {
            port,
            accept,
            connections,
            silent,
        }
    }

    /// A relay to the PostgreSQL of `url`, and `url` pointed at the relay.
    pub async fn in_front_of(url: &str) -> (Self, String) {
        let mut url = reqwest::Url::parse(url).expect("a database URL");
        let upstream = format!("{}:{}", url.host_str().unwrap(), url.port().unwrap_or(5432));
        let relay = Self::start(upstream).await;
        url.set_host(Some("127.0.0.1")).unwrap();
        url.set_port(Some(relay.port)).unwrap();
        (relay, url.to_string())
    }

    /// From now on nothing passes, either way, on any connection, old or new, until
    /// [`TcpRelay::resume`]: what was sent is held, not lost.
    pub fn silence(&self) {
        self.silent.store(true, Ordering::SeqCst);
    }

    /// Passes on what was held, and everything after it.
    pub fn resume(&self) {
        self.silent.store(false, Ordering::SeqCst);
    }

    /// Closes the listening port, then every connection relayed so far; returns once both
    /// are closed.
    pub async fn cut(self) {
        self.accept.abort();
        let _ = self.accept.await;
        self.connections.lock().await.shutdown().await;
    }
}

/// Copies `from` to `to` until either end closes, holding each chunk while the relay is
/// silent.
async fn pump(mut from: impl AsyncRead + Unpin, mut to: impl AsyncWrite + Unpin, silent: &AtomicBool) {
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let read = match from.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        while silent.load(Ordering::SeqCst) {
            tokio::time::sleep(SILENCE_POLL).await;
        }
        if to.write_all(&chunk[..read]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
