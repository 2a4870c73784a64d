//! Open connections, counted per process, so that idle ones cannot hold every slot.
//!
//! actix-server serves at most `ONCEPAY_MAX_CONNECTIONS` connections a process; at the limit
//! it stops accepting and a new client waits in the listen backlog until one closes. A
//! keep-alive connection that got its answer and sent nothing since would hold its slot for
//! the whole keep-alive (30 s), so one client with enough of them locks everyone else out.
//! Hence, in the way of Envoy's overload manager (which shortens idle timeouts and stops
//! keep-alive as it nears its limits):
//!
//! - [`Gate`] counts the process's open connections (an atomic add at accept, a subtract at
//!   close). Past 80 % of the limit ("pressure"), each new connection wakes every idle
//!   connection of the process, and those close: room is made before the limit is reached.
//! - [`IdleClose`] wraps each connection's stream, above TLS and below the dispatcher. A
//!   connection is *idle* from the first write of an answer to the next byte it reads (a
//!   `100 Continue` is not an answer: it asks for the body). Woken idle under pressure, its
//!   read ends (0 bytes): actix-http takes that for the client's end of stream and, since
//!   `serve` allows half-closed connections, finishes any answer still being written before
//!   it closes. A connection that becomes idle under pressure is kept alive for
//!   [`SHORT_KEEP_ALIVE`] instead of 30 s.
//! - A connection that is not idle is never closed here: its head or body still arriving,
//!   its request being handled, or fresh (its head has 5 s, as always).
//! - With `ONCEPAY_MAX_CONNECTIONS_PER_PEER`, the gate also counts connections by peer IP
//!   address and refuses one past the cap at accept, before TLS or any read: it is reset
//!   (no answer, no `TIME_WAIT` left here) and counts for nothing else. The count of an
//!   address is removed with its last connection, so the map holds at most one entry per open
//!   connection, and is locked only when the cap is on, once at accept and once at close.
//!
//! What a request pays, no allocation among it: a flag tested per read and write, the end of
//! each write compared with `100 Continue` until its answer is written, then two atomic loads
//! and a registration with its worker's [`Notify`] (one per worker, so the lock it takes is
//! never another worker's), undone by its next request's first read.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus::{IntCounter, IntCounterVec, IntGauge};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};

/// The keep-alive of a connection that becomes idle while the process is under pressure.
pub const SHORT_KEEP_ALIVE: Duration = Duration::from_secs(1);

/// What the dispatcher writes when a request announced `Expect: 100-continue`.
const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// The connection series of `/metrics` (constructed and registered by `crate::metrics`).
#[derive(Clone)]
pub struct ConnectionCounters {
    /// `oncepay_connections_open`: accepted and not yet closed.
    pub open: IntGauge,
    /// `oncepay_connections_max`: `ONCEPAY_MAX_CONNECTIONS`.
    pub max: IntGauge,
    /// `oncepay_connections_idle_closed_total`: idle connections closed under pressure.
    pub idle_closed: IntCounter,
    /// `oncepay_connections_refused_total{reason}`: `per_peer`, past
    /// `ONCEPAY_MAX_CONNECTIONS_PER_PEER`.
    pub refused: IntCounterVec,
    /// `oncepay_requests_rejected_total{code}`: heads the HTTP layer answered itself, before
    /// any route (`ProblemIo`): `invalid_request` (400), `headers_too_large` (431),
    /// `request_timeout` (408, a head that did not arrive: a slowloris shows here).
    pub rejected: IntCounterVec,
}

/// The process's open connections and its pressure; shared by every worker.
pub struct Gate {
    open: AtomicUsize,
    /// Under pressure past this: 80 % of the limit, rounded down.
    calm_up_to: usize,
    /// Counts the times pressure woke the idle connections: a connection idle since an
    /// earlier value closes.
    generation: AtomicU64,
    /// One wake-up per worker, handed out in turn as the workers start.
    wakes: Box<[Arc<Notify>]>,
    next_wake: AtomicUsize,
    /// Connections of one peer address at most; 0: no cap, and `peers` stays empty.
    per_peer: usize,
    /// Open connections by peer address, each at least 1.
    peers: Mutex<HashMap<IpAddr, usize>>,
    refused_per_peer: IntCounter,
    counters: ConnectionCounters,
}

impl Gate {
    pub fn new(limits: &super::Limits, counters: ConnectionCounters) -> Arc<Self> {
        let max_connections = limits.max_connections;
        counters.max.set(i64::try_from(max_connections).unwrap_or(i64::MAX));
        Arc::new(Self {
            open: AtomicUsize::new(0),
            // floor(4/5 of it), without overflow.
            calm_up_to: max_connections - max_connections.div_ceil(5),
            generation: AtomicU64::new(0),
            wakes: (0..limits.workers.max(1)).map(|_| Arc::new(Notify::new())).collect(),
            next_wake: AtomicUsize::new(0),
            per_peer: limits.max_connections_per_peer,
            peers: Mutex::new(HashMap::new()),
            refused_per_peer: counters.refused.with_label_values(&["per_peer"]),
            counters,
        })
    }

    /// The counter of the answers the HTTP layer makes itself (`ProblemIo`).
    pub fn rejected(&self) -> IntCounterVec {
        self.counters.rejected.clone()
    }

    /// The wake-up for the connections of the worker that asks: each worker asks once, when
    /// it starts (a worker that actix-server restarts after a panic gets the next one).
    pub fn worker_wake(&self) -> Arc<Notify> {
        let turn = self.next_wake.fetch_add(1, Ordering::Relaxed);
        self.wakes[turn % self.wakes.len()].clone()
    }

    /// Counts a connection just accepted from `peer`, for as long as its [`Slot`] lives; `None`
    /// when its address has its cap of connections already (it counts for nothing then, and
    /// so cannot close others' idle connections). One that takes the process past 80 % wakes
    /// the idle connections, which close.
    pub fn admit(self: &Arc<Self>, peer: Option<IpAddr>) -> Option<Slot> {
        // An IPv4 client of a listener bound to an IPv6 address is seen as ::ffff:a.b.c.d.
        let peer = peer.filter(|_| self.per_peer > 0).map(|ip| ip.to_canonical());
        if let Some(ip) = peer {
            let mut peers = self.peers();
            let open = peers.entry(ip).or_insert(0);
            if *open >= self.per_peer {
                self.refused_per_peer.inc();
                return None;
            }
            *open += 1;
        }
        let open = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        self.counters.open.inc();
        if open > self.calm_up_to {
            // The generation before the wake-ups: an idle connection either registered for
            // its wake-up before this, or reads the new generation after registering.
            self.generation.fetch_add(1, Ordering::Release);
            for wake in self.wakes.iter() {
                wake.notify_waiters();
            }
        }
        Some(Slot {
            gate: self.clone(),
            peer,
        })
    }

    /// The map stays consistent whatever panicked while holding it: each change is one
    /// integer written.
    fn peers(&self) -> MutexGuard<'_, HashMap<IpAddr, usize>> {
        self.peers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn under_pressure(&self) -> bool {
        self.open.load(Ordering::Relaxed) > self.calm_up_to
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }
}

/// One open connection, counted until dropped (with its stream, or at once if it never
/// becomes one: a TLS handshake that failed).
pub struct Slot {
    gate: Arc<Gate>,
    /// Its address, when connections are counted by address.
    peer: Option<IpAddr>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gate.open.fetch_sub(1, Ordering::Relaxed);
        self.gate.counters.open.dec();
        if let Some(ip) = self.peer {
            if let Entry::Occupied(mut open) = self.gate.peers().entry(ip) {
                *open.get_mut() -= 1;
                if *open.get() == 0 {
                    open.remove();
                }
            }
        }
    }
}

/// A connection's stream that ends its reads while idle under pressure (the module's doc).
pub struct IdleClose<T> {
    io: T,
    slot: Slot,
    wake: Arc<Notify>,
    /// Since the connection's first answer: registered with the worker's wake-up while idle,
    /// fresh (not registered) otherwise. Replaced in place, never allocated again.
    woken: Option<Pin<Box<OwnedNotified>>>,
    idle: bool,
    /// The gate's generation when the connection last became idle.
    idle_generation: u64,
    /// The short keep-alive, made the first time the connection becomes idle under pressure
    /// and reset after; `short_running` while it counts.
    short: Option<Pin<Box<Sleep>>>,
    short_running: bool,
}

impl<T> IdleClose<T> {
    /// `wake` is the worker's ([`Gate::worker_wake`]).
    pub fn new(io: T, slot: Slot, wake: Arc<Notify>) -> Self {
        Self {
            io,
            slot,
            wake,
            woken: None,
            idle: false,
            idle_generation: 0,
            short: None,
            short_running: false,
        }
    }

    /// An answer was written: idle until the next byte read. Under pressure the short
    /// keep-alive starts.
    fn become_idle(&mut self, cx: &mut Context<'_>) {
        self.idle = true;
        self.idle_generation = self.slot.gate.generation();
        if self.slot.gate.under_pressure() {
            let deadline = Instant::now() + SHORT_KEEP_ALIVE;
            match &mut self.short {
                Some(short) => short.as_mut().reset(deadline),
                None => self.short = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
            self.short_running = true;
        }
        if self.expired(cx) {
            // Pressure came between the answer and now: the dispatcher reads again at once.
            cx.waker().wake_by_ref();
        }
    }

    /// A byte arrived: a request under way, which nothing here closes.
    fn become_active(&mut self) {
        self.idle = false;
        self.short_running = false;
        if let Some(woken) = &mut self.woken {
            // Leaves the worker's list, so that pressure does not wake connections at work.
            woken.set(self.wake.clone().notified_owned());
        }
    }

    /// Whether this idle connection closes now: pressure woke it, or its short keep-alive
    /// ran out while the pressure lasts. If not, `cx` is woken when that changes.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        // Registered before the gate is read: pressure that comes after the reads below still
        // wakes the connection.
        self.listen(cx);
        let gate = &self.slot.gate;
        if gate.generation() != self.idle_generation {
            return true;
        }
        if self.short_running {
            if let Some(short) = &mut self.short {
                if short.as_mut().poll(cx).is_ready() {
                    if gate.under_pressure() {
                        return true;
                    }
                    // The pressure passed: the dispatcher's own keep-alive goes on.
                    self.short_running = false;
                }
            }
        }
        false
    }

    /// Registers `cx` with the worker's wake-up.
    fn listen(&mut self, cx: &mut Context<'_>) {
        let wake = &self.wake;
        let woken = self
            .woken
            .get_or_insert_with(|| Box::pin(wake.clone().notified_owned()));
        // A wake-up that completes was sent after it was made (pressure while the connection
        // was at work, or just now: the generation tells); a new one is made and registered.
        for _ in 0..3 {
            if woken.as_mut().poll(cx).is_pending() {
                return;
            }
            woken.set(wake.clone().notified_owned());
        }
        // Wake-ups keep coming: look again on the next poll rather than here.
        cx.waker().wake_by_ref();
    }
}

/// Whether `buf`, written by the dispatcher, ends with a `100 Continue` (or is what is left
/// of one after a short write): the client was told to send its body, and is not idle.
fn asks_for_body(buf: &[u8]) -> bool {
    buf.ends_with(CONTINUE) || (!buf.is_empty() && CONTINUE.ends_with(buf))
}

impl<T: AsyncRead + Unpin> AsyncRead for IdleClose<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.idle {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            // A request that already arrived is served, pressure or not.
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                this.become_active();
                Poll::Ready(Ok(()))
            }
            Poll::Pending if this.expired(cx) => {
                this.slot.gate.counters.idle_closed.inc();
                // End of stream: the dispatcher finishes what it writes, then closes.
                Poll::Ready(Ok(()))
            }
            // The client's own end of stream, an error, or nothing yet.
            other => other,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for IdleClose<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let written = Pin::new(&mut this.io).poll_write(cx, buf);
        if !this.idle && matches!(written, Poll::Ready(Ok(1..))) && !asks_for_body(buf) {
            this.become_idle(cx);
        }
        written
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use actix_http::body::SizedStream;
    use actix_http::{HttpService, Request, Response};
    use actix_service::{fn_service, Service, ServiceFactory};
    use actix_web::web::Bytes;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
    use tokio::task::LocalSet;

    use super::*;

    const ANSWER_BYTES: usize = 100_000;

    fn counters() -> ConnectionCounters {
        ConnectionCounters {
            open: IntGauge::new("open", "open").unwrap(),
            max: IntGauge::new("max", "max").unwrap(),
            idle_closed: IntCounter::new("idle_closed", "idle closed").unwrap(),
            refused: IntCounterVec::new(prometheus::Opts::new("refused", "refused"), &["reason"]).unwrap(),
            rejected: IntCounterVec::new(prometheus::Opts::new("rejected", "rejected"), &["code"]).unwrap(),
        }
    }

    fn gate(max_connections: usize, max_connections_per_peer: usize, counters: &ConnectionCounters) -> Arc<Gate> {
        let limits = crate::http1::Limits {
            workers: 1,
            max_connections,
            max_connections_per_peer,
            drain: std::time::Duration::ZERO,
        };
        Gate::new(&limits, counters.clone())
    }

    /// A connection served as `serve` serves one (30 s keep-alive, half-closed allowed), over
    /// an in-memory stream of 1 KiB each way: an answer of 100 kB in chunks of 1 kB is
    /// written over many writes, as fast as the client reads it. Returns the client's end.
    async fn connection(gate: &Arc<Gate>) -> DuplexStream {
        let (client, server) = tokio::io::duplex(1024);
        let h1 = HttpService::build()
            .keep_alive(Duration::from_secs(30))
            .h1_allow_half_closed(true)
            .h1(fn_service(|_: Request| async {
                // A body of many chunks: the dispatcher takes them as the writes progress, so
                // most are still to come when its read ends.
                let chunks = (0..ANSWER_BYTES / 1000).map(|_| Ok::<_, Infallible>(Bytes::from(vec![b'x'; 1000])));
                let body = SizedStream::new(ANSWER_BYTES as u64, futures_util::stream::iter(chunks));
                Ok::<_, Infallible>(Response::ok().set_body(body))
            }))
            .new_service(())
            .await
            .unwrap();
        let io = IdleClose::new(server, gate.admit(None).unwrap(), gate.worker_wake());
        tokio::task::spawn_local(async move { h1.call((io, None)).await });
        client
    }

    /// Reads up to the end of the stream, which must come well before the dispatcher's 30 s
    /// keep-alive would end it; the number of bytes.
    async fn read_to_end(client: &mut DuplexStream) -> usize {
        let mut all = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), client.read_to_end(&mut all))
            .await
            .expect("the connection ends before the keep-alive would end it")
            .unwrap();
        all.len()
    }

    /// Reads one answer whole: its head, and its body of `ANSWER_BYTES`.
    async fn read_answer(client: &mut DuplexStream) {
        let mut answer = Vec::new();
        let mut chunk = [0u8; 8192];
        for _ in 0..ANSWER_BYTES {
            let head = answer.windows(4).position(|w| w == b"\r\n\r\n");
            if head.is_some_and(|end| answer.len() == end + 4 + ANSWER_BYTES) {
                return;
            }
            match client.read(&mut chunk).await.unwrap() {
                0 => panic!("the connection ended within the answer"),
                n => answer.extend_from_slice(&chunk[..n]),
            }
        }
        panic!("no whole answer");
    }

    #[test]
    fn pressure_is_past_80_percent_of_the_limit() {
        for (limit, calm_up_to) in [(40, 32), (10, 8), (7, 5), (1, 0), (usize::MAX, usize::MAX / 5 * 4)] {
            assert_eq!(gate(limit, 0, &counters()).calm_up_to, calm_up_to, "{limit}");
        }
    }

    #[test]
    fn a_100_continue_asks_for_the_body_and_an_answer_does_not() {
        assert!(asks_for_body(CONTINUE));
        assert!(asks_for_body(
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n"
        ));
        assert!(
            asks_for_body(b"Continue\r\n\r\n"),
            "the rest of one after a short write"
        );
        assert!(!asks_for_body(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"));
        assert!(!asks_for_body(b""));
    }

    #[test]
    fn slots_count_open_connections_until_dropped() {
        let counters = counters();
        let gate = gate(10, 0, &counters);
        let slots: Vec<Slot> = (0..3).map(|_| gate.admit(None).unwrap()).collect();
        assert_eq!((gate.open.load(Ordering::Relaxed), counters.open.get()), (3, 3));
        assert_eq!(counters.max.get(), 10);
        drop(slots);
        assert_eq!((gate.open.load(Ordering::Relaxed), counters.open.get()), (0, 0));
    }

    #[test]
    fn an_address_past_its_cap_is_refused_and_its_count_leaves_with_its_last_connection() {
        let counters = counters();
        let gate = gate(100, 2, &counters);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let a_mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        let b: IpAddr = "2001:db8::1".parse().unwrap();

        let mut first = Some(gate.admit(Some(a)).unwrap());
        let _second = gate.admit(Some(a_mapped)).unwrap();
        assert!(gate.admit(Some(a)).is_none());
        assert!(
            gate.admit(Some(a_mapped)).is_none(),
            "the same address, seen through IPv6"
        );
        let _other = gate.admit(Some(b)).unwrap();
        let _unknown = gate.admit(None).expect("no address known: not capped");

        assert_eq!(counters.refused.with_label_values(&["per_peer"]).get(), 2);
        assert_eq!(gate.open.load(Ordering::Relaxed), 4, "refused ones count for nothing");
        first.take();
        let _again = gate.admit(Some(a)).unwrap();
        drop((_second, _again, _other));
        assert!(gate.peers().is_empty(), "{:?}", gate.peers());
    }

    #[test]
    fn without_a_cap_addresses_are_not_counted() {
        let gate = gate(100, 0, &counters());
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let slots: Vec<Slot> = (0..50).map(|_| gate.admit(Some(a)).unwrap()).collect();
        assert!(gate.peers().is_empty());
        drop(slots);
    }

    /// Pressure comes while the connection writes its answer: it has written part of it, and
    /// is idle from that first write. Its read ends, and the dispatcher still writes the whole
    /// answer before it closes (half-closed connections allowed), instead of keeping it open.
    #[tokio::test]
    async fn an_answer_under_way_when_pressure_comes_is_written_whole_before_the_close() {
        LocalSet::new()
            .run_until(async {
                let counters = counters();
                // Pressure past one open connection.
                let gate = gate(2, 0, &counters);
                let mut client = connection(&gate).await;
                client.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
                let mut first = [0u8; 12];
                client.read_exact(&mut first).await.unwrap();
                assert_eq!(&first, b"HTTP/1.1 200");

                let _second = gate.admit(None);

                let rest = read_to_end(&mut client).await;
                let all = first.len() + rest;
                assert!(all > ANSWER_BYTES, "the whole answer, {all} bytes");
                assert_eq!(counters.idle_closed.get(), 1);
            })
            .await;
    }

    /// Under pressure, a connection that becomes idle closes after the short keep-alive, not
    /// the dispatcher's 30 s.
    #[tokio::test]
    async fn a_connection_idle_under_pressure_closes_after_the_short_keep_alive() {
        LocalSet::new()
            .run_until(async {
                let counters = counters();
                let gate = gate(2, 0, &counters);
                let _other = gate.admit(None);
                let mut client = connection(&gate).await;

                client.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
                let all = read_to_end(&mut client).await;

                assert!(all > ANSWER_BYTES, "the whole answer, {all} bytes");
                assert_eq!(counters.idle_closed.get(), 1);
            })
            .await;
    }

    /// Without pressure the connection stays open after its answer (its keep-alive is the
    /// dispatcher's), and pressure that comes later closes it.
    #[tokio::test]
    async fn an_idle_connection_stays_open_until_pressure_comes() {
        LocalSet::new()
            .run_until(async {
                let counters = counters();
                let gate = gate(2, 0, &counters);
                let mut client = connection(&gate).await;
                client.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
                read_answer(&mut client).await;
                let mut more = [0u8; 1];
                let still_open = tokio::time::timeout(Duration::from_millis(200), client.read(&mut more)).await;
                assert!(still_open.is_err(), "closed without pressure: {still_open:?}");
                assert_eq!(counters.idle_closed.get(), 0);

                let _second = gate.admit(None);

                assert_eq!(read_to_end(&mut client).await, 0);
                assert_eq!(counters.idle_closed.get(), 1);
            })
            .await;
    }
}
