//! A TCP relay on 127.0.0.1 that a test can cut: a server built through it reaches
//! PostgreSQL until `cut`, and after it finds the port closed and its open connections
//! gone, as when the database host goes away. The shared test cluster stays up.

use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::task::{JoinHandle, JoinSet};

pub struct TcpRelay {
    pub port: u16,
    accept: JoinHandle<()>,
    connections: Arc<Mutex<JoinSet<()>>>,
}

impl TcpRelay {
    /// Relays every connection made to `127.0.0.1:port` to `upstream` (`host:port`).
    pub async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("the relay binds");
        let port = listener.local_addr().unwrap().port();
        let connections = Arc::new(Mutex::new(JoinSet::new()));
        let relayed = connections.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let upstream = upstream.clone();
                relayed.lock().await.spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Self {
            port,
            accept,
            connections,
        }
    }

    /// Closes the listening port, then every connection relayed so far; returns once both
    /// are closed.
    pub async fn cut(self) {
        self.accept.abort();
        let _ = self.accept.await;
        self.connections.lock().await.shutdown().await;
    }
}
