//! The load generator of `make bench`: drives oncepay over HTTP, or pgbench over the same SQL,
//! and prints one JSON [`Record`] per step on stdout, with the CPU per request of the servers,
//! of PostgreSQL and of the load generator itself (cpu.rs).
//!
//! Closed loop: `concurrency` workers each send a request, wait for the whole answer, record
//! its latency and send the next, until the step's time is up. Throughput is therefore what
//! the server sustains at that many requests in flight, and latencies include no queueing
//! in the generator. It runs on one thread so that it takes at most one of the machine's
//! cores, as pgbench (`-j 1`) does on the other side.

#![allow(clippy::print_stdout)] // its records on stdout are its output

mod cpu;
mod http;
mod pgbench;
mod sink;

use std::time::Duration;

use clap::{Parser, Subcommand};
use oncepay_bench::Record;

#[derive(Parser)]
#[command(about = "oncepay's benchmark load generator (closed loop)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// What every step is labelled with in its record.
#[derive(clap::Args, Clone)]
pub struct Step {
    #[arg(long)]
    scenario: String,
    #[arg(long)]
    concurrency: u32,
    #[arg(long)]
    duration_secs: f64,
    #[arg(long, default_value_t = 0)]
    key_rows: u64,
    #[arg(long, default_value_t = 1)]
    round: u32,
    #[arg(long, default_value = "")]
    note: String,
    /// The bench cluster's postmaster: the CPU of all its processes is charged to the step.
    #[arg(long)]
    pg_pid: Option<u32>,
    /// Clock ticks per second of /proc's CPU times (`getconf CLK_TCK`).
    #[arg(long, default_value_t = 100)]
    clock_ticks: u32,
}

impl Step {
    pub fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.duration_secs)
    }
}

#[derive(Subcommand)]
enum Command {
    /// Requests to oncepay instances.
    Http(http::Args),
    /// pgbench running one script (bench/sql/*.sql, or the yardstick's).
    Pgbench(pgbench::Args),
    /// A webhook receiver answering 200 to everything, until killed (the webhook steps).
    Sink(sink::Args),
}

fn main() -> anyhow::Result<()> {
    let record: Record = match Cli::parse().command {
        Command::Http(args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(http::run(args))?,
        Command::Pgbench(args) => pgbench::run(&args)?,
        Command::Sink(args) => {
            return tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(sink::run(&args));
        }
    };
    println!("{}", serde_json::to_string(&record)?);
    Ok(())
}
