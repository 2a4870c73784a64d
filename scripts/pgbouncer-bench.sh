#!/usr/bin/env bash
# New payments and replays at one concurrency, straight to PostgreSQL and through PgBouncer in
# transaction mode, side by side in one run (docs/scaling.md, "A connection pooler").
#
# Two `oncepay serve` instances on one database, alike but for the way in:
#   direct   DATABASE_URL = PostgreSQL,  ONCEPAY_DB_POOLER=none
#   pooled   DATABASE_URL = PgBouncer,   ONCEPAY_DB_POOLER=transaction
# Both run with the replay cache off (ONCEPAY_REPLAY_CACHE_ENTRIES=0), so that every replay
# reaches the database: the pooler's cost is what is measured. The steps alternate between
# the two sides, round after round, so that drift in the machine's load hits both.
#
# Environment: ONCEPAY_PG_PORT, ONCEPAY_PGBOUNCER_PORT (as for the scripts they call),
# BENCH_HTTP_PORT (the direct instance; the pooled one takes the next port, default 25150),
# BENCH_SECS (per step, default 20), BENCH_ROUNDS (default 3), BENCH_CONCURRENCY (32).
# Prints a table; the raw records go to target/pgbouncer-bench.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."

secs="${BENCH_SECS:-20}"
rounds="${BENCH_ROUNDS:-3}"
c="${BENCH_CONCURRENCY:-32}"
http_port="${BENCH_HTTP_PORT:-25150}"
accounts=10000
replay_keys=10000
db=oncepay_pgbouncer_bench
bin=target/release/oncepay
lg=target/release/oncepay-loadgen
results=target/pgbouncer-bench.jsonl

scripts/db.sh up
cargo build --release --locked -p oncepay -p oncepay-bench --quiet
admin_url="$(scripts/db.sh url postgres)"
direct_url="$(scripts/db.sh url "$db")"
pooled_url="$(scripts/pgbouncer.sh url "$db")"

# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
pids=()
cleanup() {
  stop_pids
  scripts/pgbouncer.sh down || true
  psql -X -q "$admin_url" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT
say() { echo "pgbouncer-bench: $(date +%T) $*" >&2; }

bench_database "$admin_url" "$direct_url" "$bin" "$accounts" reject
scripts/pgbouncer.sh up

start() { # side url pooler port
  RUST_LOG=warn DATABASE_URL="$2" ONCEPAY_DB_POOLER="$3" ONCEPAY_REPLAY_CACHE_ENTRIES=0 \
    ONCEPAY_BIND="127.0.0.1:$4" ONCEPAY_METRICS_BIND="127.0.0.1:$(($4 + 1000))" "$bin" serve 2>>"target/pgbouncer-bench-$1.log" &
  pids+=("$!")
  local i
  for i in $(seq 100); do curl -sf "http://127.0.0.1:$4/readyz" >/dev/null && return 0; sleep 0.1; done
  echo "pgbouncer-bench: the $1 instance never became ready" >&2
  exit 1
}
start direct "$direct_url" none "$http_port"
start pooled "$pooled_url" transaction "$((http_port + 1))"
clk="$(getconf CLK_TCK)"

step() { # scenario side round
  local port="$http_port" pid="${pids[0]}"
  [ "$2" = pooled ] && { port=$((http_port + 1)); pid="${pids[1]}"; }
  "$lg" http --side "$2" --urls "http://127.0.0.1:$port" --pids "$pid" --api-key "$api_key" --clock-ticks "$clk" \
    --scenario "$1" --concurrency "$c" --duration-secs "$secs" --round "$3" \
    --accounts "$accounts" --replay-keys "$replay_keys" >>"$results"
}

: >"$results"
say "seeding $replay_keys keys for the replays"
"$lg" http --urls "http://127.0.0.1:$http_port" --api-key "$api_key" --scenario seed --concurrency 32 \
  --duration-secs 300 --replay-keys "$replay_keys" >/dev/null
psql -X -q "$direct_url" -c "VACUUM (ANALYZE)" -c "CHECKPOINT" >/dev/null
for round in $(seq "$rounds"); do
  order="direct pooled"
  [ $((round % 2)) = 0 ] && order="pooled direct"
  for scenario in new replay; do
    for side in $order; do
      say "round $round: $scenario, $side, concurrency $c"
      step "$scenario" "$side" "$round"
    done
  done
done

echo "PgBouncer $(/usr/sbin/pgbouncer --version 2>/dev/null | head -n 1 | awk '{print $2}'), ${secs} s per step, concurrency $c, $rounds rounds"
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'scenario':8} {'side':7} {'req/s (median)':>15} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6} {'CPU ms/req':>10}")
for scenario in ("new", "replay"):
    for side in ("direct", "pooled"):
        rs = [r for r in rows if r["scenario"] == scenario and r["side"] == side]
        if not rs:
            continue
        med = lambda k: statistics.median(r[k] for r in rs)
        cpu = [r["cpu_secs_per_request"] for r in rs if r.get("cpu_secs_per_request") is not None]
        print(f"{scenario:8} {side:7} {med('throughput'):15.0f} {med('p50_ms'):7.2f} {med('p99_ms'):7.2f} "
              f"{sum(r['errors'] for r in rs):6d} {statistics.median(cpu) * 1000 if cpu else float('nan'):10.3f}")
    print("  per round:", ", ".join(f"{r['side']} {r['throughput']:.0f}" for r in rows if r["scenario"] == scenario))
PY
