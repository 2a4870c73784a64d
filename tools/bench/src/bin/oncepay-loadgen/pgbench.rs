//! The limits: pgbench running the SQL oncepay issues (bench/sql/*.sql), or the fixed
//! yardstick (bench/yardstick), at the same concurrency, its per-transaction log read
//! into the same histogram as the HTTP side.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};
use oncepay_bench::{histogram, percentiles_ms, Record};

use crate::cpu::{Client, Meter};
use crate::Step;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    step: Step,
    /// A pgbench script, e.g. bench/sql/pay.sql.
    #[arg(long)]
    script: PathBuf,
    #[arg(long)]
    database_url: String,
    /// pgbench's binary (PostgreSQL's bindir is often not on PATH).
    #[arg(long, default_value = "pgbench")]
    pgbench: PathBuf,
    /// Script variables, `name=value`, passed as `-D`.
    #[arg(long = "define", short = 'D')]
    defines: Vec<String>,
    /// Session settings of oncepay's own connections (src/db.rs), as `-c name=value ...`.
    #[arg(long, env = "PGOPTIONS", default_value = "")]
    pgoptions: String,
    /// pgbench's threads (`-j`): 1 against oncepay's one-thread load generator, 2 for the
    /// yardstick as its README runs it.
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// The side the record is labelled with.
    #[arg(long, default_value = "pgbench")]
    side: String,
}

pub fn run(args: &Args) -> anyhow::Result<Record> {
    let logs = std::env::temp_dir().join(format!("oncepay-pgbench-{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;
    let step = &args.step;
    let mut command = Command::new(&args.pgbench);
    command
        .env("PGOPTIONS", &args.pgoptions)
        .args(["-n", "-M", "prepared", "-l"])
        .arg(format!("-j{}", args.threads))
        .arg(format!("--log-prefix={}", logs.join("tx").display()))
        .arg(format!("-c{}", step.concurrency))
        .arg(format!("-T{}", step.duration_secs.ceil().max(1.0) as u64))
        .arg("-f")
        .arg(&args.script);
    for define in &args.defines {
        command.arg("-D").arg(define);
    }
    command.arg(&args.database_url);
    let meter = Meter::start(&[], step.pg_pid, step.clock_ticks, Client::Children)?;
    let output = command.output().context("cannot run pgbench")?;
    let result = summarise(&logs, step, &args.side);
    std::fs::remove_dir_all(&logs)?;
    if !output.status.success() {
        bail!("pgbench failed: {}", String::from_utf8_lossy(&output.stderr).trim());
    }
    let mut record = result?;
    // Over the whole pgbench run (its connections' set-up too), per successful transaction.
    let cpu = meter.stop(record.requests)?;
    record.pg_cpu_secs_per_request = cpu.postgres;
    record.client_cpu_secs_per_request = cpu.client;
    record.host_steal = cpu.host_steal;
    Ok(record)
}

/// Reads pgbench's per-transaction logs: `client_id tx_no latency_us script_no epoch us`,
/// where the latency is `failed` or `skipped` for a transaction that did not succeed.
fn summarise(logs: &std::path::Path, step: &Step, side: &str) -> anyhow::Result<Record> {
    let mut latencies = histogram();
    let (mut ok, mut errors) = (0u64, 0u64);
    let (mut first, mut last) = (f64::MAX, f64::MIN);
    for entry in std::fs::read_dir(logs)? {
        let text = std::fs::read_to_string(entry?.path())?;
        for line in text.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(latency), Some(epoch), Some(us)) = (fields.get(2), fields.get(4), fields.get(5)) else {
                continue;
            };
            let end = epoch.parse::<f64>().unwrap_or(0.0) + us.parse::<f64>().unwrap_or(0.0) / 1e6;
            match latency.parse::<u64>() {
                Ok(micros) => {
                    latencies.saturating_record(micros.max(1));
                    ok += 1;
                    first = first.min(end - micros as f64 / 1e6);
                    last = last.max(end);
                }
                Err(_) => errors += 1,
            }
        }
    }
    if ok == 0 {
        bail!("pgbench completed no transaction");
    }
    // Measured from the first transaction's start to the last one's end, like the HTTP side's
    // wall clock, so that connection set-up does not count against the limit.
    let elapsed = (last - first).max(1e-3);
    let (p50_ms, p99_ms, p999_ms) = percentiles_ms(&latencies);
    Ok(Record {
        side: side.to_owned(),
        scenario: step.scenario.clone(),
        concurrency: step.concurrency,
        key_rows: step.key_rows,
        round: step.round,
        duration_secs: elapsed,
        requests: ok,
        errors,
        throughput: ok as f64 / elapsed,
        p50_ms,
        p99_ms,
        p999_ms,
        cpu_secs_per_request: None,
        pg_cpu_secs_per_request: None,
        client_cpu_secs_per_request: None,
        processor_cpu_secs_per_request: None,
        cache_hits: None,
        cache_misses: None,
        note: step.note.clone(),
        host_steal: None,
        batch_limit: None,
        batches: None,
    })
}
