//! `oncepay-delay`: a TCP relay that delays every byte by a fixed time in each direction, for
//! `make bench-ha` (scripts/bench-ha.sh): a network delay between the Patroni nodes'
//! namespaces where the kernel has no `netem` qdisc (`CONFIG_NET_SCH_NETEM` is not set on the
//! development machine, nor `fq`, which would honour eBPF departure times).
//!
//! It listens on `--listen` and, for each connection, connects to `--to`; what one side sends
//! is written to the other `--delay-us` microseconds after it was read, in order, with
//! `TCP_NODELAY` on both sockets. Two threads per direction (one reads and stamps, one sleeps
//! until the stamp and writes), so a delay is not rounded to an async runtime's millisecond
//! timer: the sleep is the kernel's high-resolution one, shortened by its mean overshoot. The
//! relay adds no other wait and keeps TCP's ordering; it does not model loss or bandwidth.

#![allow(clippy::print_stderr)] // a failed connection is reported on stderr, its log

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;

#[derive(Parser)]
#[command(about = "A TCP relay that delays each direction by a fixed time")]
struct Args {
    /// Where to listen, e.g. 10.211.0.11:26433.
    #[arg(long)]
    listen: SocketAddr,
    /// Where each connection goes, e.g. 10.211.0.11:26432.
    #[arg(long)]
    to: SocketAddr,
    /// The delay of each direction, in microseconds.
    #[arg(long, default_value_t = 500)]
    delay_us: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let delay = Duration::from_micros(args.delay_us);
    let listener = TcpListener::bind(args.listen).with_context(|| format!("cannot listen on {}", args.listen))?;
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let to = args.to;
        thread::spawn(move || {
            if let Err(err) = relay(client, to, delay) {
                eprintln!("oncepay-delay: {err:#}");
            }
        });
    }
    Ok(())
}

fn relay(client: TcpStream, to: SocketAddr, delay: Duration) -> anyhow::Result<()> {
    let server = TcpStream::connect(to).with_context(|| format!("cannot connect to {to}"))?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (c2, s2) = (client.try_clone()?, server.try_clone()?);
    pump(client, s2, delay)?;
    pump(server, c2, delay)?;
    Ok(())
}

/// Copies `from` to `to`, each chunk written `delay` after it was read; at the end of `from`
/// (or on an error on either side) the other direction is shut down as well.
fn pump(mut from: TcpStream, mut to: TcpStream, delay: Duration) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let from_writer = from.try_clone()?;
    thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
    });
    thread::spawn(move || {
        // A sleep ends later than asked (timer slack, the wake-up on a busy machine: 0.24 ms
        // on average at 0.5 ms here): each sleep is shortened by the mean overshoot of the
        // earlier ones, so that the mean delay is the one asked for.
        // (At most half the delay, and fading while no sleep is needed, so that one long
        // stall of the machine does not end the sleeps for good.)
        let mut overshoot = Duration::ZERO;
        for (due, chunk) in rx {
            let now = Instant::now();
            match due.checked_duration_since(now).and_then(|d| d.checked_sub(overshoot)) {
                Some(wait) => {
                    let wake = now + wait;
                    thread::sleep(wait);
                    let late = Instant::now().saturating_duration_since(wake);
                    overshoot = ((overshoot * 7 + late) / 8).min(delay / 2);
                }
                None => overshoot = overshoot * 7 / 8,
            }
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
        let _ = from_writer.shutdown(Shutdown::Read);
    });
    Ok(())
}
