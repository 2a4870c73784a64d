//! The load generator of `make bench`: drives oncepay over HTTP, or pgbench over the same SQL,
//! and prints one JSON [`Record`] per step on stdout.
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

use std::time::Duration;

use clap::{Parser, Subcommand};
use oncepay::bench::Record;

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
    /// pgbench running one of bench/sql/*.sql.
    Pgbench(pgbench::Args),
}

fn main() -> anyhow::Result<()> {
    let record: Record = match Cli::parse().command {
        Command::Http(args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(http::run(args))?,
        Command::Pgbench(args) => pgbench::run(&args)?,
    };
    println!("{}", serde_json::to_string(&record)?);
    Ok(())
}
