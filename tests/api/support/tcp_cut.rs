//! A TCP proxy for HTTPS, which it cannot read: it relays bytes both ways, counts
//! connections, and can cut the first connection after its request went through, the
//! answer lost. It tells the request from the handshake by the TLS record headers the
//! client sends (5 bytes: type, version, length; the payload stays opaque): under TLS 1.3
//! the client's first `application_data` record is its encrypted Finished, the second one
//! carries the HTTP request.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};

const APPLICATION_DATA: u8 = 23;
const IO_TIMEOUT: Duration = Duration::from_secs(30);

pub struct TlsCutProxy {
    pub port: u16,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

struct Shared {
    upstream: SocketAddr,
    /// Cut the first connection after its request (else relay every connection whole).
    cut_first: bool,
    connections: AtomicUsize,
    /// Signalled by the proxy when the first connection's request has been passed on; from
    /// then on the server's bytes on it are held back, never delivered.
    request_through: Notify,
    /// Signalled by the test: close the first connection now.
    cut: Notify,
}

impl TlsCutProxy {
    /// A proxy to `127.0.0.1:upstream_port` relaying every connection whole.
    pub async fn relay(upstream_port: u16) -> Self {
        Self::start(upstream_port, false).await
    }

    /// A proxy that holds back the server's answer to the first connection's request and
    /// closes that connection when [`TlsCutProxy::cut`] is called.
    pub async fn cutting_the_first(upstream_port: u16) -> Self {
        Self::start(upstream_port, true).await
    }

    async fn start(upstream_port: u16, cut_first: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("the proxy binds");
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Shared {
            upstream: SocketAddr::from(([127, 0, 0, 1], upstream_port)),
            cut_first,
            connections: AtomicUsize::new(0),
            request_through: Notify::new(),
            cut: Notify::new(),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Self { port, shared, accept }
    }

    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// Waits (at most 10 s) until the first connection's request has reached the server.
    pub async fn request_through(&self) {
        tokio::time::timeout(Duration::from_secs(10), self.shared.request_through.notified())
            .await
            .expect("the client's request went through the proxy within 10 s");
    }

    /// Closes the first connection, its answer undelivered.
    pub fn cut(&self) {
        self.shared.cut.notify_one();
    }
}

impl Drop for TlsCutProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        let Ok((client, _)) = listener.accept().await else {
            return;
        };
        let index = shared.connections.fetch_add(1, Ordering::SeqCst);
        let shared = shared.clone();
        connections.spawn(async move {
            let Ok(server) = TcpStream::connect(shared.upstream).await else {
                return;
            };
            let _ = tokio::time::timeout(IO_TIMEOUT, async {
                if index == 0 && shared.cut_first {
                    cut_after_request(client, server, &shared).await;
                } else {
                    relay(client, server).await;
                }
            })
            .await;
        });
        while connections.try_join_next().is_some() {}
    }
}

async fn relay(mut client: TcpStream, mut server: TcpStream) {
    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
}

async fn cut_after_request(client: TcpStream, server: TcpStream, shared: &Shared) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let holding = AtomicBool::new(false);
    let upstream = async {
        let mut records = RecordCounter::default();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            let read = client_read.read(&mut chunk).await.unwrap_or(0);
            if read == 0 {
                return;
            }
            // Hold the answers back before the request can reach the server.
            if records.feed(&chunk[..read]) >= 2 && !holding.swap(true, Ordering::SeqCst) {
                shared.request_through.notify_one();
            }
            if server_write.write_all(&chunk[..read]).await.is_err() {
                return;
            }
        }
    };
    let downstream = async {
        let mut chunk = [0u8; 16 * 1024];
        loop {
            let read = server_read.read(&mut chunk).await.unwrap_or(0);
            if read == 0 {
                return;
            }
            if !holding.load(Ordering::SeqCst) && client_write.write_all(&chunk[..read]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = shared.cut.notified() => {}
        _ = async { tokio::join!(upstream, downstream) } => {}
    }
    // Dropping both halves of both sockets closes the connections.
}

/// Counts the `application_data` records of a TLS stream from its record headers.
#[derive(Default)]
struct RecordCounter {
    header: Vec<u8>,
    /// Payload bytes of the current record still to skip.
    remaining: usize,
    application_data: usize,
}

impl RecordCounter {
    fn feed(&mut self, mut bytes: &[u8]) -> usize {
        while !bytes.is_empty() {
            if self.remaining > 0 {
                let skip = self.remaining.min(bytes.len());
                self.remaining -= skip;
                bytes = &bytes[skip..];
                continue;
            }
            let take = (5 - self.header.len()).min(bytes.len());
            self.header.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.header.len() == 5 {
                if self.header[0] == APPLICATION_DATA {
                    self.application_data += 1;
                }
                self.remaining = usize::from(u16::from_be_bytes([self.header[3], self.header[4]]));
                self.header.clear();
            }
        }
        self.application_data
    }
}
