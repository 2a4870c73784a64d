//! The figures: groups of rounds, ratios to the limit, the targets of issue 5, Markdown.

use std::collections::BTreeMap;
use std::fmt::Write;

use oncepay::bench::Record;

/// What identifies a group of rounds.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key {
    pub scenario: String,
    pub key_rows: u64,
    pub concurrency: u32,
    pub side: String,
    pub note: String,
}

#[derive(Clone, Debug)]
pub struct Group {
    pub rounds: usize,
    pub errors: u64,
    pub throughput: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub cpu_ms_per_request: Option<f64>,
}

pub type Groups = BTreeMap<Key, Group>;

pub fn key(side: &str, scenario: &str, concurrency: u32, key_rows: u64) -> Key {
    Key {
        scenario: scenario.to_owned(),
        key_rows,
        concurrency,
        side: side.to_owned(),
        note: String::new(),
    }
}

pub fn group(records: &[Record]) -> Groups {
    let mut by_key: BTreeMap<Key, Vec<&Record>> = BTreeMap::new();
    for r in records {
        let k = Key {
            note: r.note.clone(),
            ..key(&r.side, &r.scenario, r.concurrency, r.key_rows)
        };
        by_key.entry(k).or_default().push(r);
    }
    by_key
        .into_iter()
        .map(|(k, rs)| {
            let n = rs.len() as f64;
            let mean = |f: fn(&Record) -> f64| rs.iter().map(|r| f(r)).sum::<f64>() / n;
            let seconds: f64 = rs.iter().map(|r| r.duration_secs).sum();
            let requests: u64 = rs.iter().map(|r| r.requests).sum();
            let cpu: Vec<f64> = rs.iter().filter_map(|r| r.cpu_secs_per_request).collect();
            let group = Group {
                rounds: rs.len(),
                errors: rs.iter().map(|r| r.errors).sum(),
                throughput: requests as f64 / seconds.max(1e-9),
                p50_ms: mean(|r| r.p50_ms),
                p99_ms: mean(|r| r.p99_ms),
                p999_ms: mean(|r| r.p999_ms),
                cpu_ms_per_request: (!cpu.is_empty()).then(|| cpu.iter().sum::<f64>() / cpu.len() as f64 * 1000.0),
            };
            (k, group)
        })
        .collect()
}

/// The pgbench scenario an oncepay scenario is compared with.
fn limit_of(scenario: &str) -> Option<&'static str> {
    match scenario {
        "new" | "keyless" => Some("new"),
        "replay" => Some("replay"),
        "hot" => Some("hot"),
        _ => None,
    }
}

fn ratio(groups: &Groups, k: &Key) -> Option<f64> {
    if k.side == "pgbench" {
        return None;
    }
    let limit = groups.get(&key("pgbench", limit_of(&k.scenario)?, k.concurrency, k.key_rows))?;
    Some(groups.get(k)?.throughput / limit.throughput)
}

fn rows_label(rows: u64) -> String {
    match rows {
        0 => "0".to_owned(),
        r if r % 1_000_000 == 0 => format!("{}M", r / 1_000_000),
        r => format!("{}k", r / 1000),
    }
}

/// The key-table sizes measured, smallest first.
pub fn sizes(groups: &Groups) -> Vec<u64> {
    let mut sizes: Vec<u64> = groups.keys().map(|k| k.key_rows).collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

struct Target {
    what: &'static str,
    goal: &'static str,
    value: Option<f64>,
    /// The same figure for pgbench, where it has one: how much of a miss is PostgreSQL's own.
    limit: Option<f64>,
    met: fn(f64) -> bool,
}

fn targets(groups: &Groups) -> Vec<Target> {
    let get = |side: &str, scenario: &str, c: u32, rows: u64| groups.get(&key(side, scenario, c, rows));
    let sizes = sizes(groups);
    let (small, big) = (sizes.get(1).copied(), sizes.last().copied().filter(|&b| b > 0));
    let new32 = get("oncepay", "new", 32, 0);
    let replay32 = get("oncepay", "replay", 32, 0);
    let purge = groups
        .iter()
        .find(|(k, _)| k.side == "oncepay" && k.note.starts_with("purge"))
        .map(|(_, g)| g);
    let no_purge = small.and_then(|s| get("oncepay", "new", 32, s));
    vec![
        Target {
            what: "new payments, c=32: oncepay / pgbench (one round trip)",
            goal: ">= 0.7",
            value: ratio(groups, &key("oncepay", "new", 32, 0)),
            limit: None,
            met: |v| v >= 0.7,
        },
        Target {
            what: "replays / new payments, oncepay, c=32",
            goal: ">= 2",
            value: replay32.zip(new32).map(|(r, n)| r.throughput / n.throughput),
            limit: get("pgbench", "replay", 32, 0)
                .zip(get("pgbench", "new", 32, 0))
                .map(|(r, n)| r.throughput / n.throughput),
            met: |v| v >= 2.0,
        },
        Target {
            what: "replays, c=32: oncepay / pgbench (the replay's statement)",
            goal: ">= 0.3",
            value: ratio(groups, &key("oncepay", "replay", 32, 0)),
            limit: None,
            met: |v| v >= 0.3,
        },
        Target {
            what: "new payments, c=32: p99 / p50",
            goal: "<= 3",
            value: new32.map(|g| g.p99_ms / g.p50_ms),
            limit: get("pgbench", "new", 32, 0).map(|g| g.p99_ms / g.p50_ms),
            met: |v| v <= 3.0,
        },
        Target {
            what: "new payments, c=32: throughput at the largest key table / at 0 rows",
            goal: ">= 0.8",
            value: big
                .and_then(|b| get("oncepay", "new", 32, b))
                .zip(new32)
                .map(|(b, z)| b.throughput / z.throughput),
            limit: big
                .and_then(|b| get("pgbench", "new", 32, b))
                .zip(get("pgbench", "new", 32, 0))
                .map(|(b, z)| b.throughput / z.throughput),
            met: |v| v >= 0.8,
        },
        Target {
            what: "new payments, c=32: p99 during the purge / p99 without it (same table size)",
            goal: "<= 2",
            value: purge.zip(no_purge).map(|(p, n)| p.p99_ms / n.p99_ms),
            limit: None,
            met: |v| v <= 2.0,
        },
    ]
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

pub fn markdown(records: &[Record], groups: &Groups, machine: &str) -> String {
    let mut md = String::new();
    let w = &mut md;
    let _ = writeln!(
        w,
        "# oncepay benchmark report\n\nWritten by `make bench` (scripts/bench.sh). Machine and run:\n"
    );
    for line in machine.lines() {
        let _ = writeln!(w, "- {line}");
    }
    let _ = writeln!(w, "\n## Targets (issue 5), measured side by side in this run\n");
    let _ = writeln!(
        w,
        "| target | goal | measured | met | pgbench's own figure |\n| --- | --- | --- | --- | --- |"
    );
    for t in targets(groups) {
        let met = t
            .value
            .map_or("not measured", |v| if (t.met)(v) { "yes" } else { "**no**" });
        let _ = writeln!(
            w,
            "| {} | {} | {} | {met} | {} |",
            t.what,
            t.goal,
            opt(t.value, 2),
            opt(t.limit, 2)
        );
    }
    let _ = writeln!(
        w,
        "\n## All figures\n\nThroughput in requests (or pgbench transactions) per second; latencies in ms; \
         CPU is the oncepay process(es)' user + system time per request; the ratio is to pgbench \
         running the same statement at the same concurrency and key-table size (keyless: to new payments).\n"
    );
    let _ = writeln!(
        w,
        "| scenario | key rows | c | side | rounds | throughput | p50 | p99 | p99.9 | errors | CPU ms/req | ratio | note |"
    );
    let _ = writeln!(
        w,
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for (k, g) in groups {
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} |",
            k.scenario,
            rows_label(k.key_rows),
            k.concurrency,
            k.side,
            g.rounds,
            g.throughput,
            g.p50_ms,
            g.p99_ms,
            g.p999_ms,
            g.errors,
            opt(g.cpu_ms_per_request, 3),
            opt(ratio(groups, k), 2),
            k.note
        );
    }
    let _ = writeln!(
        w,
        "\n## Round by round (the alternation)\n\nNew payments at c=32, 0 key rows:\n"
    );
    let _ = writeln!(
        w,
        "| round | pgbench tps | oncepay rps | ratio |\n| --- | --- | --- | --- |"
    );
    let pick = |side: &str, round: u32| {
        records.iter().find(|r| {
            r.side == side && r.scenario == "new" && r.concurrency == 32 && r.key_rows == 0 && r.round == round
        })
    };
    for round in 1..=records.iter().map(|r| r.round).max().unwrap_or(0) {
        if let (Some(p), Some(o)) = (pick("pgbench", round), pick("oncepay", round)) {
            let _ = writeln!(
                w,
                "| {round} | {:.0} | {:.0} | {:.2} |",
                p.throughput,
                o.throughput,
                o.throughput / p.throughput
            );
        }
    }
    let _ = writeln!(
        w,
        "\n## Charts\n\n![throughput against concurrency](throughput_vs_concurrency.png)\n\n\
         ![latency percentiles](latency_percentiles.png)\n\n![throughput against key-table size](throughput_vs_key_rows.png)"
    );
    md
}
