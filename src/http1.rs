//! The HTTP/1.1 server: the actix-web `App` behind actix-http's h1 dispatcher, as
//! `HttpServer::listen` assembles it, with one difference: every error is problem+json, also
//! those the dispatcher answers by itself before any route runs.
//!
//! actix-http 3 answers three kinds of request with a bodiless response of its own, and
//! offers no hook to change it (`Response::bad_request()`, `Response::with_body(431, ())`,
//! `Response::with_body(408, ())` in `h1/dispatcher.rs`):
//!
//! - 400 for a head it cannot parse (bad request line, header, `Content-Length` or chunk
//!   framing, `Content-Length` with `Transfer-Encoding`, ...), and for a URL over 65,534
//!   bytes (the `http` crate's limit on a URI; 414 would be the exact status),
//! - 431 for a head over 128 KiB or 96 headers,
//! - 408 for a head that does not arrive within the client request timeout.
//!
//! [`ProblemIo`] sits between the socket and the dispatcher and replaces those heads, and
//! only those, with a problem+json answer (codes `invalid_request`, `headers_too_large`,
//! `request_timeout`). The dispatcher's own heads are recognised exactly: status 400, 408 or
//! 431 with `content-length: 0`, which no answer of the application has (its errors carry a
//! body), at the start of a response (no body the application writes contains CR LF: JSON
//! escapes it, the metrics text uses LF). The dispatcher closes the connection after each
//! of them, so nothing follows the rewritten answer.
//!
//! Every connection is counted by one [`connections::Gate`] per process, and its stream is
//! an [`IdleClose`]: past 80 % of `ONCEPAY_MAX_CONNECTIONS`, idle keep-alive connections
//! close first (`connections`).

mod connections;

use std::fmt;
use std::future::Future;
use std::io;
use std::net::TcpListener;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use actix_http::body::MessageBody;
use actix_http::error::DispatchError;
use actix_http::{HttpService, Request, Response};
use actix_service::{fn_service, map_config, IntoServiceFactory, Service, ServiceFactory, ServiceFactoryExt};
use actix_web::dev::{AppConfig, Server};
use memchr::memmem;
use oncepay_protocol::ProblemCode;
use prometheus::IntCounterVec;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::either::Either;

pub use connections::ConnectionCounters;
use connections::{Gate, IdleClose};

/// Slow clients (slowloris) are dropped: the head within 5 s (else 408), then 1 s to close.
const CLIENT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
const CLIENT_DISCONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const KEEP_ALIVE: Duration = Duration::from_secs(30);
/// A connection whose client stops reading is closed once a write has made no progress for
/// this long ([`StallTimeout`]): the dispatcher's timeouts do not apply while it writes.
pub const WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How many connections the server serves at once.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Worker threads (`ONCEPAY_WORKERS`).
    pub workers: usize,
    /// Open connections of the process (`ONCEPAY_MAX_CONNECTIONS`). actix-server counts them
    /// per worker: each worker takes up to this over `workers`, rounded up, and past it new
    /// connections wait in the listen backlog.
    pub max_connections: usize,
    /// Open connections from one peer IP address (`ONCEPAY_MAX_CONNECTIONS_PER_PEER`); more
    /// are refused at accept. 0: no cap.
    pub max_connections_per_peer: usize,
    /// How long a graceful stop waits for the requests in flight (rounded up to seconds).
    pub drain: Duration,
}

impl Limits {
    fn per_worker(&self) -> usize {
        self.max_connections.div_ceil(self.workers.max(1))
    }
}

/// Serves `app` on `listener` within `limits`; what `HttpServer::new(app).listen()`
/// does, with the dispatcher's own error answers made problem+json. With `tls`, each
/// connection is a TLS one first (handshake within the client request timeout), and the
/// rewriting sits between TLS and the dispatcher, so HTTPS answers the same problems.
pub fn serve<F, I, S, B>(
    listener: TcpListener,
    limits: Limits,
    counters: ConnectionCounters,
    tls: Option<rustls::ServerConfig>,
    app: F,
) -> io::Result<Server>
where
    F: Fn() -> I + Send + Clone + 'static,
    I: IntoServiceFactory<S, Request>,
    S: ServiceFactory<Request, Config = AppConfig> + 'static,
    S::Error: Into<actix_web::Error> + 'static,
    S::InitError: fmt::Debug,
    S::Response: Into<Response<B>> + 'static,
    <S::Service as Service<Request>>::Future: 'static,
    S::Service: 'static,
    B: MessageBody + 'static,
{
    let addr = listener.local_addr()?;
    let tls = tls.map(|mut config| {
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        TlsAcceptor::from(std::sync::Arc::new(config))
    });
    let gate = Gate::new(&limits, counters);
    let builder = actix_server::Server::build();
    let shutdown = builder.graceful_shutdown_signal();
    Ok(builder
        .workers(limits.workers)
        .max_concurrent_connections(limits.per_worker())
        .shutdown_timeout(limits.drain.as_secs() + u64::from(limits.drain.subsec_nanos() > 0))
        .listen("oncepay", listener, move || {
            let shutdown = shutdown.clone();
            let tls = tls.clone();
            let gate = gate.clone();
            let wake = gate.worker_wake();
            let app = app().into_factory().map_err(|err| err.into().error_response());
            let h1 = HttpService::build()
                .keep_alive(KEEP_ALIVE)
                .client_request_timeout(CLIENT_REQUEST_TIMEOUT)
                .client_disconnect_timeout(CLIENT_DISCONNECT_TIMEOUT)
                .h1_allow_half_closed(true)
                .local_addr(addr)
                .graceful_shutdown_signal(move || {
                    let shutdown = shutdown.clone();
                    async move { shutdown.notified().await }
                })
                .h1(map_config(app, move |_| AppConfig::default()));
            fn_service(move |io: TcpStream| {
                let tls = tls.clone();
                let peer = io.peer_addr().ok();
                let slot = gate.admit(peer.map(|peer| peer.ip()));
                let wake = wake.clone();
                let rejected = gate.rejected();
                async move {
                    let Some(slot) = slot else {
                        // Past its address's cap: closed now, before TLS or any read, with a
                        // reset rather than a FIN, so that a flood of them leaves no TIME_WAIT
                        // here. The error ends the connection's service quietly.
                        let _ = io.set_zero_linger();
                        return Err(DispatchError::Io(io::ErrorKind::ConnectionRefused.into()));
                    };
                    let io = match tls {
                        None => Either::Left(io),
                        Some(tls) => {
                            let handshake = tokio::time::timeout(CLIENT_REQUEST_TIMEOUT, tls.accept(io)).await;
                            let stream = handshake
                                .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))
                                .and_then(|accepted| accepted)
                                .map_err(DispatchError::Io)?;
                            Either::Right(stream)
                        }
                    };
                    let io = ProblemIo::new(StallTimeout::new(io, WRITE_STALL_TIMEOUT), rejected);
                    Ok((IdleClose::new(io, slot, wake), peer))
                }
            })
            .and_then(h1)
        })?
        .run())
}

/// A connection whose writes fail (`TimedOut`, and the dispatcher drops the connection) once
/// one has been pending, without a byte accepted by the socket, for `limit`: a client that
/// sends requests and never reads the answers (150 pipelined, kept 2.8 MB queued for over a
/// minute before) cannot hold a connection and its buffers forever.
pub struct StallTimeout<T> {
    io: T,
    limit: Duration,
    /// Running while a write is pending without progress.
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> StallTimeout<T> {
    pub fn new(io: T, limit: Duration) -> Self {
        Self { io, limit, stall: None }
    }

    /// After a write or flush returned `Pending`: `Ready(Err)` once the stall has lasted
    /// `limit`, else `Pending` (the timer wakes the task at the limit).
    fn stalled(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let limit = self.limit;
        let stall = self.stall.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match stall.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client read nothing of the answer for the write stall timeout",
            )),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallTimeout<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallTimeout<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.io).poll_write(cx, buf) {
            Poll::Pending => self.stalled(cx).map(Err),
            done => {
                self.stall = None;
                done
            }
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.io).poll_flush(cx) {
            Poll::Pending => self.stalled(cx).map(Err),
            done => {
                self.stall = None;
                done
            }
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A connection whose dispatcher-made error heads are rewritten as problem+json answers.
pub struct ProblemIo<T> {
    io: T,
    /// `oncepay_requests_rejected_total{code}`: each rewritten answer counted by its code.
    rejected: IntCounterVec,
    /// A rewritten answer, accepted from the dispatcher and not yet all written.
    pending: Vec<u8>,
    written: usize,
}

impl<T> ProblemIo<T> {
    pub fn new(io: T, rejected: IntCounterVec) -> Self {
        Self {
            io,
            rejected,
            pending: Vec::new(),
            written: 0,
        }
    }
}

impl<T: AsyncWrite + Unpin> ProblemIo<T> {
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.pending.len() {
            match ready!(Pin::new(&mut self.io).poll_write(cx, &self.pending[self.written..]))? {
                0 => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                n => self.written += n,
            }
        }
        self.pending.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ProblemIo<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ProblemIo<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        ready!(self.drain(cx))?;
        match find_dispatcher_error(buf) {
            // The dispatcher hands over whole heads: the first write that starts with one
            // holds all of it.
            Some(DispatcherError { at: 0, len, problem }) => {
                self.rejected.with_label_values(&[problem.code]).inc();
                self.pending = problem_answer(&buf[..len], problem);
                // Written now as far as the socket takes it; the rest on flush.
                if let Poll::Ready(Err(err)) = self.drain(cx) {
                    return Poll::Ready(Err(err));
                }
                Poll::Ready(Ok(len))
            }
            // Up to the error head first, so that the next write starts with it.
            Some(DispatcherError { at, .. }) => Pin::new(&mut self.io).poll_write(cx, &buf[..at]),
            None => Pin::new(&mut self.io).poll_write(cx, buf),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.drain(cx))?;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.drain(cx))?;
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The problem an error head of the dispatcher stands for.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Problem {
    status: u16,
    code: &'static str,
    title: &'static str,
    detail: &'static str,
}

const PROBLEMS: [Problem; 3] = [
    Problem {
        status: 400,
        code: ProblemCode::InvalidRequest.as_str(),
        title: "Invalid request",
        detail: "the request could not be parsed: not valid HTTP/1.1 (request line, a header, Content-Length, Transfer-Encoding or chunk framing), or a URL (path and query) over 65,534 bytes; nothing was processed",
    },
    Problem {
        status: 408,
        code: ProblemCode::RequestTimeout.as_str(),
        title: "Request timeout",
        detail: "the request head did not arrive within 5 seconds; nothing was processed",
    },
    Problem {
        status: 431,
        code: ProblemCode::HeadersTooLarge.as_str(),
        title: "Request header fields too large",
        detail: "the request head exceeds 128 KiB or 96 header fields; nothing was processed",
    },
];

#[derive(Debug, PartialEq)]
struct DispatcherError {
    /// Where the head starts in the buffer, and its length up to its blank line.
    at: usize,
    len: usize,
    problem: Problem,
}

/// The first bodiless 400/408/431 head in `buf`, as the dispatcher writes it:
/// `HTTP/1.x <status> <reason>\r\ncontent-length: 0\r\n...\r\n\r\n`.
///
/// Every response passes through here, so it allocates nothing and searches with `memmem`
/// (callgrind: the first version, `windows().position()` and a `format!` per candidate,
/// cost 10k instructions per request, a tenth of the server's work for a payment).
fn find_dispatcher_error(buf: &[u8]) -> Option<DispatcherError> {
    for at in memmem::find_iter(buf, b"HTTP/1.") {
        let head = &buf[at..];
        let Some(problem) = head
            .get(9..13)
            .and_then(|status| PROBLEMS.iter().find(|p| status == p.status_and_space()))
        else {
            continue;
        };
        let Some(line_end) = memmem::find(head, b"\r\n") else {
            continue;
        };
        if !head[line_end..].starts_with(b"\r\ncontent-length: 0\r\n") {
            continue;
        }
        let end = memmem::find(head, b"\r\n\r\n")? + 4;
        return Some(DispatcherError {
            at,
            len: end,
            problem: *problem,
        });
    }
    None
}

impl Problem {
    /// `"400 "`: the status as it follows `HTTP/1.x ` in a status line.
    fn status_and_space(&self) -> [u8; 4] {
        let s = self.status;
        [
            b'0' + (s / 100) as u8,
            b'0' + (s / 10 % 10) as u8,
            b'0' + (s % 10) as u8,
            b' ',
        ]
    }
}

/// The answer replacing a dispatcher's error `head`: its status line and headers (the date),
/// the connection closed, and a problem+json body as `ApiError` renders one.
fn problem_answer(head: &[u8], problem: Problem) -> Vec<u8> {
    let body = serde_json::json!({
        "type": format!("https://oncepay.dev/problems/{}", problem.code),
        "title": problem.title,
        "status": problem.status,
        "detail": problem.detail,
        "code": problem.code,
    })
    .to_string();
    let text = String::from_utf8_lossy(head);
    let mut lines = text.split("\r\n").filter(|l| !l.is_empty());
    let status_line = lines.next().unwrap_or_default();
    let mut out = format!(
        "{status_line}\r\ncontent-type: application/problem+json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for line in lines.filter(|l| {
        let name = l.split(':').next().unwrap_or_default().to_ascii_lowercase();
        !matches!(name.as_str(), "content-length" | "connection")
    }) {
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    out.push_str(&body);
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOO_LARGE: &[u8] = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\ndate: Tue, 01 Dec 2026 02:42:15 GMT\r\n\r\n";

    #[test]
    fn the_dispatchers_bodiless_error_heads_are_found_and_nothing_else() {
        let found = find_dispatcher_error(TOO_LARGE).unwrap();
        assert_eq!(
            (found.at, found.len, found.problem.code),
            (0, TOO_LARGE.len(), "headers_too_large")
        );

        // After a pipelined answer (the dispatcher omits `connection: close` then).
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 15\r\ncontent-type: application/json\r\n\r\n{\"status\":\"ok\"}";
        let bad = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: Tue, 01 Dec 2026 02:42:15 GMT\r\n\r\n";
        let both = [&ok[..], &bad[..]].concat();
        let found = find_dispatcher_error(&both).unwrap();
        assert_eq!(
            (found.at, found.len, found.problem.code),
            (ok.len(), bad.len(), "invalid_request")
        );

        // The application's own errors have a body; other statuses are not the dispatcher's.
        for not_it in [
            &b"HTTP/1.1 400 Bad Request\r\ncontent-length: 190\r\ncontent-type: application/problem+json\r\n\r\n{}"[..],
            b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n",
        ] {
            assert_eq!(
                find_dispatcher_error(not_it),
                None,
                "{}",
                String::from_utf8_lossy(not_it)
            );
        }
    }

    #[test]
    fn the_answer_keeps_status_and_date_and_carries_a_problem() {
        let answer = String::from_utf8(problem_answer(TOO_LARGE, PROBLEMS[2])).unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
            "{head}"
        );
        assert!(head.contains("\r\ndate: Tue, 01 Dec 2026 02:42:15 GMT"), "{head}");
        assert!(
            head.contains("\r\ncontent-type: application/problem+json\r\n"),
            "{head}"
        );
        assert!(
            head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())),
            "{head}"
        );
        assert_eq!(head.matches("connection:").count(), 1, "{head}");
        let problem: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(problem["code"], "headers_too_large");
        assert_eq!(problem["status"], 431);
        assert_eq!(problem["type"], "https://oncepay.dev/problems/headers_too_large");
    }
}
