#!/usr/bin/env bash
# `make bench-ab BASE_BIN=dir` (about 5 minutes): this tree's release server against another
# build of oncepay (BASE_BIN/oncepay, e.g. a worktree of an older commit built with
# `cargo build --release`), side by side in one run: one instance each, a database each on the
# local cluster migrated by its own binary, the same load generator (this tree's), rounds
# alternated so that the machine's drift falls on both sides alike. Scenarios: new payments
# and replays (BENCH_AB_REPLAY_CACHE=0 turns this tree's replay cache off, for a comparison of
# the database paths), at BENCH_AB_CONCURRENCY clients (32); BENCH_AB_SCENARIOS names others
# of oncepay-loadgen's (e.g. "list-first": the first page of 100 of GET /payments, over the
# payments the other scenarios made; "list-deep": a page from a cursor halfway through them,
# each side's own). Prints one line per step and, per scenario, the tree/base ratios of the
# medians of throughput and of p99.
# BENCH_AB_BASE_ENV / BENCH_AB_TREE_ENV ("NAME=VALUE ...") add settings to one side's server:
# with BASE_BIN=target/release the same build is compared with itself under other settings
# (e.g. BENCH_AB_TREE_ENV="ONCEPAY_DB_POOL_SIZE=8").
#
# What `make bench` cannot do: it measures one build. A change's "before and after in one run"
# is this script.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
cd "$top"

base_bin="${BASE_BIN:?set BASE_BIN to the directory of the other build}"
secs="${BENCH_AB_SECS:-10}"
concurrency="${BENCH_AB_CONCURRENCY:-32}"
rounds="${BENCH_AB_ROUNDS:-3}"
scenarios="${BENCH_AB_SCENARIOS:-new replay}"
port="${BENCH_AB_PORT:-18310}"
accounts=10000
replay_keys=10000
lg=target/release/oncepay-loadgen
[ "${BENCH_NO_BUILD:-0}" = 1 ] || SQLX_OFFLINE=true cargo build --release --locked -p oncepay -p oncepay-bench --quiet
[ -x "$base_bin/oncepay" ] || { echo "bench-ab: $base_bin/oncepay not found" >&2; exit 1; }
say() { echo "bench-ab: $(date +%T) $*" >&2; }

scripts/db.sh up
admin_url="$(scripts/db.sh url postgres)"
pg_pid="$(head -n 1 "$(scripts/db.sh datadir)/postmaster.pid")"
clk="$(getconf CLK_TCK)"
out="target/bench-ab"
mkdir -p "$out"
: >"$out/results.jsonl"

# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
pids=()
cleanup() {
  stop_pids
  psql -X -q "$admin_url" -c "DROP DATABASE IF EXISTS oncepay_ab_base WITH (FORCE)" \
    -c "DROP DATABASE IF EXISTS oncepay_ab_tree WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

declare -A url key pid db
setup() { # side binary port [NAME=VALUE ...]
  local side="$1" bin="$2" p="$3" u tenant api_key
  shift 3
  u="$(scripts/db.sh url "oncepay_ab_$side")"
  bench_database "$admin_url" "$u" "$bin" "$accounts"
  key[$side]="$api_key"
  db[$side]="$u"
  env DATABASE_URL="$u" RUST_LOG=warn ONCEPAY_BIND="127.0.0.1:$p" ONCEPAY_METRICS_BIND="127.0.0.1:$((p + 1000))" "$@" "$bin" serve 2>>"$out/server-$side.log" &
  pid[$side]=$!
  pids+=("$!")
  url[$side]="http://127.0.0.1:$p"
  for _ in $(seq 100); do curl -sf "${url[$side]}/readyz" >/dev/null && break; sleep 0.1; done
  curl -sf "${url[$side]}/readyz" >/dev/null || { echo "bench-ab: the $side server did not start" >&2; exit 1; }
  say "$side: $bin on ${url[$side]}; seeding $replay_keys keys"
  "$lg" http --urls "${url[$side]}" --api-key "${key[$side]}" --scenario seed --concurrency 32 \
    --duration-secs 300 --replay-keys "$replay_keys" >/dev/null
  psql -X -q "$u" -c "VACUUM ANALYZE" >/dev/null
}
# shellcheck disable=SC2086 # the settings are split into words on purpose
setup base "$base_bin/oncepay" "$port" ${BENCH_AB_BASE_ENV:-}
# shellcheck disable=SC2086
setup tree target/release/oncepay "$((port + 1))" ONCEPAY_REPLAY_CACHE_ENTRIES="${BENCH_AB_REPLAY_CACHE:-100000}" \
  ${BENCH_AB_TREE_ENV:-}

# A cursor halfway through the side's payments, newest first, read before the first round
# (list-deep pages from it; the payments made later are newer and lie before it).
middle() { # side
  psql -X -q -tA "${db[$1]}" -c "SELECT payment_id FROM payments ORDER BY created_at DESC, payment_id DESC
    OFFSET (SELECT count(*) / 2 FROM payments) LIMIT 1"
}
declare -A cursor
for side in base tree; do cursor[$side]="$(middle "$side")"; done

printf '%-10s %-5s %-6s %10s %8s %12s %12s %8s\n' scenario side round "req/s" "p99 ms" "server µs" "postgres µs" errors
for round in $(seq "$rounds"); do
  for scenario in $scenarios; do
    for side in base tree; do
      "$lg" http --side "$side" --urls "${url[$side]}" --pids "${pid[$side]}" --api-key "${key[$side]}" \
        --clock-ticks "$clk" --pg-pid "$pg_pid" --scenario "$scenario" --concurrency "$concurrency" --duration-secs "$secs" \
        --round "$round" --accounts "$accounts" --replay-keys "$replay_keys" --cursor "${cursor[$side]}" |
        tee -a "$out/results.jsonl" |
        python3 -c '
import json, sys
r = json.load(sys.stdin)
us = lambda v: "%.0f" % (v * 1e6) if v is not None else "-"
print("%-10s %-5s %-6d %10.0f %8.2f %12s %12s %8d" % (r["scenario"], r["side"], r["round"], r["throughput"],
      r["p99_ms"], us(r["cpu_secs_per_request"]), us(r["pg_cpu_secs_per_request"]), r["errors"]))'
    done
  done
done
python3 - "$out/results.jsonl" $scenarios <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for scenario in sys.argv[2:]:
    t = {s: statistics.median(r["throughput"] for r in rows if r["scenario"] == scenario and r["side"] == s)
         for s in ("base", "tree")}
    pg = {s: statistics.median(r["pg_cpu_secs_per_request"] for r in rows if r["scenario"] == scenario and r["side"] == s)
          for s in ("base", "tree")}
    p99 = {s: statistics.median(r["p99_ms"] for r in rows if r["scenario"] == scenario and r["side"] == s)
           for s in ("base", "tree")}
    print(f"{scenario}: tree/base throughput {t['tree'] / t['base']:.2f} (medians {t['tree']:.0f} / {t['base']:.0f} req/s), "
          f"p99 {p99['tree'] / p99['base']:.2f} ({p99['tree']:.2f} / {p99['base']:.2f} ms), "
          f"PostgreSQL CPU per request {pg['tree'] * 1e6:.0f} / {pg['base'] * 1e6:.0f} µs")
EOF
