#!/usr/bin/env python3
"""REPORT.md of `make bench-ha` (scripts/bench-ha.sh) from its results.jsonl and machine.txt.

usage: bench-ha-report.py RESULTS MACHINE OUT

Medians over the rounds of each (scenario, side); a target's ratio is the ratio of the two
sides' medians, both measured in every round, alternated. Writes one line per target,
`target: <name> ratio=<r> goal=<g> met=<yes|no>`, in the report (scripts/bench-ha.sh prints
them)."""

import json
import statistics
import sys

results, machine, out = sys.argv[1:4]
rows = [json.loads(line) for line in open(results) if line.strip()]
machine_lines = [line.rstrip("\n") for line in open(machine) if line.strip()]


def steps(scenario, side, c=32):
    return [r for r in rows if r["scenario"] == scenario and r["side"] == side and r["concurrency"] == c]


def med(rs, key):
    vals = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def ms(x):
    return "-" if x is None else f"{x * 1000:.3f}"


def extra(rs, group):
    vals = [r.get("extra_cpu_ms_per_request", {}).get(group) for r in rs]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


TARGETS = [
    # name, scenario, side, against side, goal, what[, concurrency (default 32)]
    ("sync-new-payments", "new", "oncepay", "yardstick", 1.5,
     "new payments, c=32, synchronous cluster: oncepay / yardstick `pay_once` (one round trip)"),
    ("sync-new-payments-c32", "new", "oncepay", "yardstick", 1.0,
     "new payments, c=32, synchronous cluster: oncepay / yardstick `pay_once` (the batcher's floor)"),
    ("sync-new-payments-c128", "new", "oncepay", "yardstick", 1.2,
     "new payments, c=128, synchronous cluster: oncepay / yardstick `pay_once`", 128),
    ("sync-replays", "replay", "oncepay", "yardstick", 1.0,
     "replays, c=32, synchronous cluster: oncepay / yardstick replay `SELECT`"),
    ("pgbouncer-new-payments", "new", "pgbouncer, cache off", "direct, cache off", 0.9,
     "new payments, c=32: through PgBouncer (transaction mode) / direct"),
    ("pgbouncer-db-replays", "replay", "pgbouncer, cache off", "direct, cache off", 0.7,
     "replays reaching the database (cache off), c=32: through PgBouncer / direct"),
]

o = []
w = o.append


def header(*columns):
    w("| " + " | ".join(columns) + " |")
    w("|" + " --- |" * len(columns))

w("# oncepay on a synchronously replicated cluster and through PgBouncer: benchmark report")
w("")
w("Written by `make bench-ha` (scripts/bench-ha.sh, scripts/bench-ha-report.py). A shared "
  "machine: absolute figures move with its load; ratios of steps run side by side, alternated "
  "in the same rounds, are what count. [analysis.md](analysis.md) reads these figures.")
w("")
for line in machine_lines:
    w(f"- {line}")
w("")
w("## Targets, same run, c=32 unless named")
w("")
header("target", "goal", "measured", "met", "per round")
lines = []
for name, scenario, side, base, goal, what, *at in TARGETS:
    c = at[0] if at else 32
    a, b = med(steps(scenario, side, c), "throughput"), med(steps(scenario, base, c), "throughput")
    if a is None or b is None or b == 0:
        lines.append(f"target: {name} ratio=nan goal={goal} met=no")
        w(f"| {what} | >= {goal} | not measured | **no** | - |")
        continue
    ratio = a / b
    met = ratio >= goal
    per_round = []
    for rnd in sorted({r["round"] for r in steps(scenario, side, c)}):
        x = [r["throughput"] for r in steps(scenario, side, c) if r["round"] == rnd]
        y = [r["throughput"] for r in steps(scenario, base, c) if r["round"] == rnd]
        if x and y:
            per_round.append(f"{x[0] / y[0]:.2f}")
    lines.append(f"target: {name} ratio={ratio:.2f} goal={goal} met={'yes' if met else 'no'}")
    w(f"| {what} | >= {goal} | {ratio:.2f} ({a:.0f} / {b:.0f} per s) | {'yes' if met else '**no**'} | {', '.join(per_round)} |")
for side in sorted({r["side"] for r in rows if r["scenario"] == "new" and r["side"].startswith("oncepay, ")}):
    a, b = med(steps("new", side), "throughput"), med(steps("new", "yardstick"), "throughput")
    if a and b:
        w(f"| (not a target) new payments, c=32, synchronous cluster: {side} / yardstick | - | {a / b:.2f} ({a:.0f} / {b:.0f} per s) | - | - |")
w("")
w("```")
for line in lines:
    w(line)
w("```")
w("")

w("## Statements in flight, chosen by the batcher")
w("")
w("New payments: each oncepay side's limit on batch statements in flight when its steps ended "
  "(`oncepay_db_batches_in_flight_limit`, median over the rounds; the instances choose it from "
  "the statements' latency, but the one pinned for comparison), and its payments per "
  "committed statement, beside the yardstick at the same concurrency.")
w("")
header("c", "side", "per second", "/ yardstick", "limit", "payments per statement")
for conc in sorted({r["concurrency"] for r in rows if r["scenario"] == "new"}):
    y = med(steps("new", "yardstick", conc), "throughput")
    for side in sorted({r["side"] for r in rows if r["scenario"] == "new" and r["concurrency"] == conc
                        and r["side"].startswith("oncepay")}):
        rs = steps("new", side, conc)
        t = med(rs, "throughput")
        st = sum((r.get("batches") or {}).get("statements", 0) for r in rs)
        pay = sum((r.get("batches") or {}).get("payments", 0) for r in rs)
        limit = med(rs, "batch_limit")
        w(f"| {conc} | {side} | {t:.0f} | {'-' if not y else f'{t / y:.2f}'} | "
          f"{'-' if limit is None else f'{limit:.1f}'} | {f'{pay / st:.1f}' if st else '-'} |")
w("")

order = [("new", "yardstick"), ("new", "oncepay")]
order += sorted({(r["scenario"], r["side"]) for r in rows if r["scenario"] == "new" and r["side"].startswith("oncepay, ")})
order += [("new", "oncepay x3"),
         ("new", "direct, cache off"), ("new", "pgbouncer, cache off"),
         ("replay", "yardstick"), ("replay", "oncepay"),
         ("replay", "direct, cache off"), ("replay", "pgbouncer, cache off"),
         ("storm", "oncepay x3 cache off"), ("storm", "oncepay x3 cache on"),
         ("storm", "oncepay x3 cache on, key affinity")]
order += sorted({(r["scenario"], r["side"]) for r in rows} - set(order))


def measured():
    """(scenario, side, its records) for each side measured, in the report's order."""
    for scenario, side in order:
        rs = steps(scenario, side)
        if rs:
            yield scenario, side, rs


w("## Who spends the CPU, per request")
w("")
w("User + system CPU milliseconds per answered request (pgbench: per transaction), read from "
  "/proc before and after each step, medians over the rounds: the oncepay process(es) of the "
  "step; the primary's PostgreSQL (postmaster, its live and reaped children); the two "
  "standbys' PostgreSQL (replaying the primary's WAL, and their walreceivers); the three "
  "delay relays (the network here); HAProxy; PgBouncer; the load generator (oncepay-loadgen "
  "or pgbench). All of them share the machine's cores.")
w("")
header("scenario", "side", "per second", "oncepay", "primary", "standbys", "relays", "HAProxy", "PgBouncer",
       "load generator", "total")
for scenario, side, rs in measured():
    parts = [med(rs, "cpu_secs_per_request"), med(rs, "pg_cpu_secs_per_request")]
    ex = [extra(rs, g) for g in ("standbys", "relays", "haproxy", "pgbouncer")]
    ex = [None if v is None else v / 1000 for v in ex]
    client = med(rs, "client_cpu_secs_per_request")
    total = sum(v for v in parts + ex + [client] if v is not None)
    cells = [ms(v) for v in parts + ex + [client, total]]
    w(f"| {scenario} | {side} | {med(rs, 'throughput'):.0f} | " + " | ".join(cells) + " |")
w("")

WAL = ("LWLock:WALWrite", "IO:WALSync", "IO:WALWrite", "LWLock:WALInsert", "IO:WALInitSync", "IO:WALInitWrite")


def classify(ev):
    if ev == "CPU":
        return "CPU"
    if ev == "IPC:SyncRep":
        return "standbys"
    if ev in WAL:
        return "WAL flush"
    if ev.startswith("Lock:") or ev.startswith("LWLock:"):
        return "locks"
    if ev == "idle in transaction" or ev == "Client:ClientRead":
        return "client"
    return "other"


CLASSES = ["CPU", "standbys", "WAL flush", "locks", "client", "other"]
w("## Where a payment's time goes on the primary")
w("")
w("The primary's `pg_stat_activity` sampled every 25 ms during each step: each backend of the "
  "step's database that is running a statement or is inside a transaction, by what it is doing. "
  "`CPU`: running (no wait event); `standbys`: its commit waiting for the synchronous standbys "
  "(`IPC:SyncRep`); `WAL flush`: waiting for its own WAL write and fsync; `locks`: a row or "
  "other lock; `client`: idle inside a transaction, waiting for the client's next message "
  "(the pooler's extra round trips); `other`: the rest (named in the last column). Shares of "
  "the sampled backend time, summed over the rounds; `busy` is the mean number of such backends "
  "(at most the instance's pool, 16, or pgbench's 32 clients). `per statement` is the payments "
  "per committed statement from the instances' `oncepay_db_batch_size`; `p50` the client's "
  "median latency.")
w("")
header("scenario", "side", "busy", *CLASSES, "per statement", "p50 ms", "other events")
for scenario, side, rs in measured():
    db = "oncepay_yardstick" if side == "yardstick" else "oncepay"
    counts, samples, others = {c: 0 for c in CLASSES}, 0, {}
    for r in rs:
        samples += r.get("wait_samples", 0)
        for ev, n in r.get("waits", {}).get(db, {}).items():
            k = classify(ev)
            counts[k] += n
            if k == "other":
                others[ev] = others.get(ev, 0) + n
    total = sum(counts.values())
    if not total:
        continue
    st = sum((r.get("batches") or {}).get("statements", 0) for r in rs)
    pay = sum((r.get("batches") or {}).get("payments", 0) for r in rs)
    per = f"{pay / st:.1f}" if st else "-"
    oth = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(others.items(), key=lambda kv: -kv[1])[:3]) or "-"
    w(f"| {scenario} | {side} | {total / max(samples, 1):.1f} | "
      + " | ".join(f"{counts[c] / total:.0%}" for c in CLASSES)
      + f" | {per} | {med(rs, 'p50_ms'):.2f} | {oth} |")
w("")

w("## Through PgBouncer: what the pooler saw")
w("")
w("PgBouncer's `SHOW STATS` before and after each step through it (summed over the rounds): "
  "queries are the statements and protocol syncs it forwarded, a transaction a server "
  "connection's use from its assignment to its release.")
w("")
header("scenario", "requests", "transactions", "queries", "queries / transaction", "transactions / request",
       "µs per transaction", "µs per query", "client wait µs per transaction")
for scenario in ("new", "replay"):
    rs = [r for r in steps(scenario, "pgbouncer, cache off") if r.get("pgbouncer")]
    if not rs:
        continue
    d = {k: sum(r["pgbouncer"][k] for r in rs) for k in rs[0]["pgbouncer"]}
    req = sum(r["requests"] for r in rs)
    x, q = d["total_xact_count"], d["total_query_count"]
    w(f"| {scenario} | {req} | {x} | {q} | {q / x:.2f} | {x / max(req, 1):.2f} | {d['total_xact_time'] / x:.0f} | "
      f"{d['total_query_time'] / max(q, 1):.0f} | {d['total_wait_time'] / x:.0f} |")
w("")

w("## All figures")
w("")
w("Medians over the rounds; latencies in ms.")
w("")
header("scenario", "side", "rounds", "per second", "p50", "p99", "p99.9", "errors", "cache hits", "cache misses")
for scenario, side, rs in measured():
    hits = sum(r["cache_hits"] for r in rs if r.get("cache_hits") is not None)
    misses = sum(r["cache_misses"] for r in rs if r.get("cache_misses") is not None)
    w(f"| {scenario} | {side} | {len(rs)} | {med(rs, 'throughput'):.0f} | {med(rs, 'p50_ms'):.2f} | "
      f"{med(rs, 'p99_ms'):.2f} | {med(rs, 'p999_ms'):.2f} | {sum(r['errors'] for r in rs)} | "
      f"{hits if side != 'yardstick' else '-'} | {misses if side != 'yardstick' else '-'} |")
w("")
w("## Round by round")
w("")
header("round", "scenario", "side", "per second", "p50", "p99")
for r in rows:
    w(f"| {r['round']} | {r['scenario']} | {r['side']} | {r['throughput']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
w("")
open(out, "w").write("\n".join(o))
print("\n".join(lines))
