//! Turns the bench's results.jsonl into REPORT.md and PNG charts (`make bench`'s last step).
//!
//! Each (side, scenario, concurrency, key rows, note) group sums its rounds: throughput is
//! all answered requests over all measured seconds; latency percentiles and CPU per request
//! are the mean of the rounds' values (each round has its own histogram).

mod charts;
mod summary;

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use oncepay_bench::Record;

#[derive(Parser)]
#[command(about = "Writes REPORT.md and charts from the bench's results")]
struct Args {
    #[arg(long)]
    input: PathBuf,
    /// The machine description the bench wrote (machine.txt).
    #[arg(long)]
    machine: PathBuf,
    #[arg(long)]
    out: PathBuf,
    /// A TrueType font for the charts' text (Debian: fonts-dejavu-core).
    #[arg(long, default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")]
    font: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let text = std::fs::read_to_string(&args.input).with_context(|| format!("cannot read {:?}", args.input))?;
    let records = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str::<Record>)
        .collect::<Result<Vec<_>, _>>()
        .context("results.jsonl has a bad line")?;
    let machine = std::fs::read_to_string(&args.machine).unwrap_or_default();
    let groups = summary::group(&records);
    let font = std::fs::read(&args.font).with_context(|| format!("no font at {:?}", args.font))?;
    charts::draw(&groups, &args.out, Box::leak(font.into_boxed_slice()))?;
    let report = summary::markdown(&records, &groups, &machine);
    std::fs::write(args.out.join("REPORT.md"), report)?;
    Ok(())
}
