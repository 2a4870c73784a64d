//! A stand-in for the database on 127.0.0.1 that a test switches between [`Mode`]s: closing
//! every connection (PostgreSQL down), refusing the login as PgBouncer does after a failed
//! server login, or relaying to the test cluster. It counts the connections it accepted: the
//! attempts of the server under test.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::support::helpers::database_url;

/// What the stand-in for the database does with the connections it accepts.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum Mode {
    /// Closes it at once: the database is down.
    Closes,
    /// Answers the start-up with PgBouncer's refusal while `server_login_retry` runs.
    RefusesLogins,
    /// Relays it to the test cluster.
    Relays,
}

/// A TCP peer on 127.0.0.1 in front of the test cluster, switched between [`Mode`]s.
pub struct DatabasePeer {
    port: u16,
    mode: Arc<AtomicU8>,
    accepted: Arc<AtomicUsize>,
    accept: JoinHandle<()>,
}

impl DatabasePeer {
    pub async fn start(mode: Mode) -> Self {
        let upstream = reqwest::Url::parse(&database_url()).expect("DATABASE_URL is a URL");
        let upstream = format!("{}:{}", upstream.host_str().unwrap(), upstream.port().unwrap_or(5432));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("the peer binds");
        let port = listener.local_addr().unwrap().port();
        let (mode, accepted) = (Arc::new(AtomicU8::new(mode as u8)), Arc::new(AtomicUsize::new(0)));
        let (switch, count) = (mode.clone(), accepted.clone());
        let accept = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let upstream = upstream.clone();
                match switch.load(Ordering::SeqCst) {
                    m if m == Mode::Closes as u8 => drop(inbound),
                    m if m == Mode::RefusesLogins as u8 => {
                        connections.spawn(async move {
                            let _ = refuse_login(inbound).await;
                        });
                    }
                    _ => {
                        connections.spawn(async move {
                            let mut inbound = inbound;
                            if let Ok(mut outbound) = TcpStream::connect(&upstream).await {
                                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                            }
                        });
                    }
                }
            }
        });
        Self {
            port,
            mode,
            accepted,
            accept,
        }
    }

    pub fn switch(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::SeqCst);
    }

    /// The connections accepted so far: the server's attempts.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// `DATABASE_URL` through this peer, to database `url`'s name.
    pub fn url_to(&self, url: &str) -> String {
        let mut url = reqwest::Url::parse(url).expect("a database URL");
        url.set_host(Some("127.0.0.1")).unwrap();
        url.set_port(Some(self.port)).unwrap();
        url.to_string()
    }

    /// Waits (at most `within`) until the server has come `attempts` times.
    pub async fn wait_for_attempts(&self, attempts: usize, within: Duration) {
        tokio::time::timeout(within, async {
            while self.accepted() < attempts {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{} attempts within {within:?}, not {attempts}", self.accepted()));
    }
}

impl Drop for DatabasePeer {
    /// Stops accepting; the task's connections end with it.
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// PostgreSQL's `SSLRequest` code: sqlx asks for TLS first (`sslmode=prefer`).
const SSL_REQUEST: u32 = 80_877_103;

/// Reads the start-up packet (after declining TLS) and answers it with the error PgBouncer
/// sends while a failed server login holds it back (`server_login_retry`), then closes.
async fn refuse_login(mut socket: TcpStream) -> std::io::Result<()> {
    let mut length = socket.read_u32().await?;
    let mut code = socket.read_u32().await?;
    if code == SSL_REQUEST {
        socket.write_all(b"N").await?;
        length = socket.read_u32().await?;
        code = socket.read_u32().await?;
    }
    assert_eq!(code, 196_608, "a start-up packet of protocol 3.0");
    let mut parameters = vec![0; length.saturating_sub(8) as usize];
    socket.read_exact(&mut parameters).await?;
    let mut fields = Vec::new();
    for (kind, value) in [
        (b'S', "FATAL"),
        (b'V', "FATAL"),
        (b'C', "08P01"),
        (
            b'M',
            "server login has been failing, try again later (server_login_retry)",
        ),
    ] {
        fields.push(kind);
        fields.extend_from_slice(value.as_bytes());
        fields.push(0);
    }
    fields.push(0);
    let mut message = vec![b'E'];
    message.extend_from_slice(&(u32::try_from(fields.len()).unwrap() + 4).to_be_bytes());
    message.extend_from_slice(&fields);
    socket.write_all(&message).await?;
    socket.shutdown().await
}
