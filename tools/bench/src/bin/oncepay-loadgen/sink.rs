//! `oncepay-loadgen sink`: a webhook receiver for the bench's webhook steps. It reads each
//! request whole (head and `Content-Length` body) and answers `200` with an empty body, on
//! keep-alive connections, until it is killed; with `--delay-ms`, each answer after that long
//! (the slow endpoints of the fair-shares steps). It verifies nothing: the tests' receiver
//! does (tests/api/support/webhook_receiver.rs); here it only has to keep up.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(clap::Args)]
pub struct Args {
    /// Listens on 127.0.0.1:PORT.
    #[arg(long)]
    port: u16,
    /// Answers each request this many milliseconds after it arrived.
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
}

pub async fn run(args: &Args) -> anyhow::Result<()> {
    let listener = TcpListener::bind(("127.0.0.1", args.port)).await?;
    let delay = Duration::from_millis(args.delay_ms);
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(async move {
            let _ = serve(stream, delay).await;
        });
    }
}

async fn serve(mut stream: TcpStream, delay: Duration) -> std::io::Result<()> {
    let mut buffer: Vec<u8> = Vec::with_capacity(4096);
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
        let head = String::from_utf8_lossy(&buffer[..head_end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buffer.len() < head_end + length {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buffer.extend_from_slice(&chunk[..n]);
        }
        buffer.drain(..head_end + length);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        stream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .await?;
    }
}
