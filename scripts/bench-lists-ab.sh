#!/usr/bin/env bash
# `make bench-lists-ab BASE_BIN=dir` (about 3 minutes, 7 more the first time): make bench's list
# page steps (issue 39's p99 rows) for this tree's server and another build of oncepay
# (BASE_BIN/oncepay) side by side, each against pgbench's bare indexed `SELECT ... LIMIT 100` of
# the same rows (bench/sql/list_page.sql), in one run: one tenant's BENCH_LISTS_ROWS payments
# (10 million, as make bench; kept in the database oncepay_bench_lists_ab and filled again only
# when its row count differs), a page of 100 at c=8, the first and one deep (after the payment
# halfway through), BENCH_LISTS_SECS (6) a step, BENCH_LISTS_ROUNDS (5) rounds, the three sides'
# order reversed every other round so that the host's drift falls on all alike. Prints each
# step and, per page, the medians of p99 over pgbench's for both builds. BASE_BIN=target/release
# compares this build with itself (BENCH_LISTS_TREE_ENV="NAME=VALUE ..." adds settings to the
# tree's server).
#
# Why: the list rows moved from 1.62 / 1.83 (make bench of 2026-12-06 04:23) to 1.18 / 1.03
# (15:41) with no change to a page's path; this run, with the build of 04:23 beside the tree,
# showed the host's state had moved them (docs/bench/README.md, results of 15:41).
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
cd "$top"
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh

base_bin="${BASE_BIN:?set BASE_BIN to the directory of the other build}"
rows="${BENCH_LISTS_ROWS:-10000000}"
secs="${BENCH_LISTS_SECS:-6}"
rounds="${BENCH_LISTS_ROUNDS:-5}"
port="${BENCH_LISTS_PORT:-18501}"
accounts=10000
lg=target/release/oncepay-loadgen
[ "${BENCH_NO_BUILD:-0}" = 1 ] || SQLX_OFFLINE=true cargo build --release --locked -p oncepay -p oncepay-bench --quiet
[ -x "$base_bin/oncepay" ] || { echo "bench-lists-ab: $base_bin/oncepay not found" >&2; exit 1; }
say() { echo "bench-lists-ab: $(date +%T) $*" >&2; }

scripts/db.sh up
admin_url="$(scripts/db.sh url postgres)"
url="$(scripts/db.sh url oncepay_bench_lists_ab)"
bindir="$(scripts/db.sh bindir)"
clk="$(getconf CLK_TCK)"
pg_pid="$(head -n 1 "$(scripts/db.sh datadir)/postmaster.pid")"
pgoptions="-c lock_timeout=5000ms -c statement_timeout=15000ms -c idle_in_transaction_session_timeout=60s"
out="target/bench-lists-ab"
mkdir -p "$out"
results="$out/results.jsonl"
: >"$results"

# The tenant and its key are kept beside the database they belong to.
have="$(psql -X -qtA "$url" -c "SELECT count(*) FROM payments" 2>/dev/null || echo none)"
if [ "$have" != "$rows" ] || [ ! -s "$out/tenant" ]; then
  say "filling $rows payments of one tenant"
  bench_database "$admin_url" "$url" target/release/oncepay "$accounts"
  psql -X -q -v ON_ERROR_STOP=1 "$url" \
    -c "INSERT INTO payments (tenant_id, payment_id, account_id, amount, balance_after, created_at)
        SELECT '$tenant', gen_random_uuid(), (g % $accounts)::text, 1, 1, now() - make_interval(secs => g / 4.0)
          FROM generate_series(1, $rows) g" -c "VACUUM (ANALYZE)" -c "CHECKPOINT" >/dev/null
  echo "$tenant $api_key" >"$out/tenant"
else
  DATABASE_URL="$url" target/release/oncepay migrate 2>/dev/null
fi
read -r tenant api_key <"$out/tenant"
IFS='|' read -r deep_id deep_at < <(psql -X -qtA "$url" -c "SELECT payment_id, created_at FROM payments
    WHERE tenant_id = '$tenant' ORDER BY created_at DESC, payment_id DESC OFFSET $rows / 2 LIMIT 1")

declare -A pid server
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
start() { # side bin port [NAME=VALUE...]
  local side="$1" bin="$2" p="$3"
  shift 3
  env DATABASE_URL="$url" RUST_LOG=warn ONCEPAY_BIND="127.0.0.1:$p" ONCEPAY_METRICS_BIND="127.0.0.1:$((p + 1000))" \
    ONCEPAY_WEBHOOK_CONCURRENCY=0 "$@" "$bin" serve >/dev/null 2>>"$out/server-$side.log" &
  pid[$side]=$!
  pids+=("$!")
  server[$side]="http://127.0.0.1:$p"
  for _ in $(seq 100); do curl -sf "${server[$side]}/readyz" >/dev/null && break; sleep 0.1; done
  curl -sf "${server[$side]}/readyz" >/dev/null || { echo "bench-lists-ab: the $side server did not start" >&2; exit 1; }
  # Warm, unmeasured: the pool's connections and the list's plans.
  "$lg" http --urls "${server[$side]}" --api-key "$api_key" --scenario list-first --concurrency 8 --duration-secs 2 >/dev/null
}
start base "$base_bin/oncepay" "$port"
# shellcheck disable=SC2086 # the settings are split into words on purpose
start tree target/release/oncepay "$((port + 1))" ${BENCH_LISTS_TREE_ENV:-}

step() { # side scenario round
  local side="$1" scenario="$2" round="$3" cursor_id=ffffffff-ffff-ffff-ffff-ffffffffffff cursor_at=infinity args=()
  if [ "$scenario" = list-deep ]; then cursor_id="$deep_id" cursor_at="$deep_at" args=(--cursor "$deep_id"); fi
  if [ "$side" = pgbench ]; then
    "$lg" pgbench --pgbench "$bindir/pgbench" --pgoptions="$pgoptions" --database-url "$url" \
      --script bench/sql/list_page.sql --scenario "$scenario" --concurrency 8 --duration-secs "$secs" --key-rows 0 \
      --round "$round" --clock-ticks "$clk" --pg-pid "$pg_pid" \
      -D "tenant=$tenant" -D "cursor_at=$cursor_at" -D "cursor_id=$cursor_id" >>"$results"
  else
    "$lg" http --side "$side" --urls "${server[$side]}" --pids "${pid[$side]}" --api-key "$api_key" \
      --clock-ticks "$clk" --pg-pid "$pg_pid" --scenario "$scenario" --concurrency 8 --duration-secs "$secs" \
      --round "$round" "${args[@]}" >>"$results"
  fi
}
for round in $(seq "$rounds"); do
  say "round $round"
  order="pgbench tree base"
  [ $((round % 2)) = 0 ] && order="base tree pgbench"
  for scenario in list-first list-deep; do
    for side in $order; do step "$side" "$scenario" "$round"; done
  done
done

python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
us = lambda v: "-" if v is None else "%.0f" % (v * 1e6)
print("%-10s %-7s %5s %9s %8s %8s %10s %12s" % ("scenario", "side", "round", "req/s", "p50 ms", "p99 ms", "server µs", "postgres µs"))
for r in rows:
    print("%-10s %-7s %5d %9.0f %8.3f %8.3f %10s %12s" % (r["scenario"], r["side"], r["round"], r["throughput"],
          r["p50_ms"], r["p99_ms"], us(r.get("cpu_secs_per_request")), us(r["pg_cpu_secs_per_request"])))
for scenario in ("list-first", "list-deep"):
    p99 = {s: statistics.median(r["p99_ms"] for r in rows if r["scenario"] == scenario and r["side"] == s)
           for s in ("pgbench", "tree", "base")}
    print("%s: p99 over pgbench's (medians), tree %.2f, base %.2f (goal <= 1.5; pgbench %.2f ms)" % (
          scenario, p99["tree"] / p99["pgbench"], p99["base"] / p99["pgbench"], p99["pgbench"]))
PY
