#!/usr/bin/env bash
# `make bench` (about 15 minutes) and `make bench-quick` (BENCH_QUICK=1, about 3): oncepay side
# by side with its limit, pgbench running the very SQL oncepay issues (bench/sql/), in
# alternation so that machine drift hits both sides alike. Writes results.jsonl, REPORT.md and
# PNG charts to $BENCH_OUT (docs/bench for the full run, target/bench-quick for the quick one).
#
# It builds in release mode, starts the local PostgreSQL if needed (scripts/db.sh), recreates
# the database oncepay_bench, starts three oncepay instances (RUST_LOG=warn: the per-request
# info line costs CPU that is not oncepay's protocol) and stops them by pid on exit.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
cd "$top"

quick="${BENCH_QUICK:-0}"
if [ "$quick" = 1 ]; then
  secs=2; rounds=1; small=100000; big=300000; out="${BENCH_OUT:-target/bench-quick}"
else
  secs=6; rounds=2; small=1000000; big=10000000; out="${BENCH_OUT:-docs/bench}"
fi
port="${BENCH_PORT:-18131}"
db="${BENCH_DB:-oncepay_bench}"
replay_keys=10000
accounts=10000

font=/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
if [ ! -f "$font" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "bench: installing fonts-dejavu-core for the charts' text" >&2
  apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fonts-dejavu-core >&2
fi
scripts/db.sh up
bindir="$(scripts/db.sh bindir)"
url="$(scripts/db.sh url "$db")"
admin_url="$(scripts/db.sh url postgres)"
SQLX_OFFLINE=true cargo build --release --locked --features bench --quiet
bin=target/release/oncepay
lg=target/release/oncepay-loadgen
mkdir -p "$out"
results="$out/results.jsonl"
: >"$results"

pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  psql -X -q "$admin_url" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

sql() { psql -X -q -v ON_ERROR_STOP=1 -tA "$url" "$@"; }
say() { echo "bench: $(date +%T) $*" >&2; }

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), nproc $(nproc)"
  echo "memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "kernel: $(uname -r)"
  echo "postgresql: $("$bindir/postgres" --version)"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "mode: $([ "$quick" = 1 ] && echo quick || echo full), ${secs} s per step, $rounds round(s)"
  [ -n "${BENCH_NOTE:-}" ] && echo "note: $BENCH_NOTE"
} >"$out/machine.txt"

say "database $db"
psql -X -q "$admin_url" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db" >/dev/null
export DATABASE_URL="$url"
"$bin" migrate 2>/dev/null
tenant_json="$("$bin" tenant create --name bench --missing-key-policy fingerprint 2>/dev/null)"
tenant="$(sed -n 's/.*"tenant_id":"\([^"]*\)".*/\1/p' <<<"$tenant_json")"
api_key="$(sed -n 's/.*"api_key":"\([^"]*\)".*/\1/p' <<<"$tenant_json")"
sql -c "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance)
        SELECT '$tenant', g::text, 1000000000000, 1000000000000 FROM generate_series(0, $((accounts - 1))) g"

urls=()
for i in 0 1 2; do
  RUST_LOG=warn ONCEPAY_BIND="127.0.0.1:$((port + i))" "$bin" serve 2>>target/bench-server.log &
  pids+=("$!")
  urls+=("http://127.0.0.1:$((port + i))")
done
for u in "${urls[@]}"; do
  for _ in $(seq 100); do curl -sf "$u/readyz" >/dev/null && break; sleep 0.1; done
  curl -sf "$u/readyz" >/dev/null || { echo "bench: $u never became ready" >&2; exit 1; }
done
# A fourth instance differs only in its pool size: the pool decides how many commits reach
# PostgreSQL at once (group commit), so the bench measures the default against a larger one.
alt_pool="${BENCH_ALT_POOL:-64}"
RUST_LOG=warn ONCEPAY_DB_POOL_SIZE="$alt_pool" ONCEPAY_BIND="127.0.0.1:$((port + 3))" "$bin" serve 2>>target/bench-server.log &
pids+=("$!")
alt_url="http://127.0.0.1:$((port + 3))"
for _ in $(seq 100); do curl -sf "$alt_url/readyz" >/dev/null && break; sleep 0.1; done
one="${urls[0]}"
three="$(IFS=,; echo "${urls[*]}")"
all_pids="$(IFS=,; echo "${pids[*]}")"
clk="$(getconf CLK_TCK)"

http() { # scenario concurrency key_rows round [side urls pids] [extra loadgen args...]
  local scenario="$1" c="$2" rows="$3" round="$4" side="${5:-oncepay}" u="${6:-$one}" p="${7:-${pids[0]}}"
  shift 7 2>/dev/null || shift $#
  "$lg" http --side "$side" --urls "$u" --pids "$p" --api-key "$api_key" --clock-ticks "$clk" \
    --scenario "$scenario" --concurrency "$c" --duration-secs "$secs" --key-rows "$rows" --round "$round" \
    --accounts "$accounts" --replay-keys "$replay_keys" "$@" >>"$results"
}
# oncepay's connections carry these from their start-up packet (src/db.rs); pgbench's alone
# get them (psql's fills must not inherit the statement timeout).
pgoptions="-c lock_timeout=5000ms -c statement_timeout=15000ms -c idle_in_transaction_session_timeout=60s"
pgb() { # script scenario concurrency key_rows round [-D name=value ...]
  local script="$1" scenario="$2" c="$3" rows="$4" round="$5"
  shift 5
  "$lg" pgbench --pgbench "$bindir/pgbench" --pgoptions="$pgoptions" --database-url "$url" --script "bench/sql/$script.sql" \
    --scenario "$scenario" --concurrency "$c" --duration-secs "$secs" --key-rows "$rows" --round "$round" \
    -D "tenant=$tenant" -D derived=false -D "fp=\\x$fp" -D window=86400 -D amount=1 "$@" >>"$results"
}

say "seeding $replay_keys keys for the replay scenarios"
"$lg" http --urls "$one" --api-key "$api_key" --scenario seed --concurrency 32 --duration-secs 300 \
  --replay-keys "$replay_keys" >/dev/null
fp="$(sql -c "SELECT encode(fingerprint, 'hex') FROM idempotency_keys WHERE tenant_id = '$tenant' AND key = '1000000000'")"
[ -n "$fp" ] || { echo "bench: the seeded keys are missing" >&2; exit 1; }

settle() { sql -c "VACUUM (ANALYZE) idempotency_keys" -c "VACUUM (ANALYZE) payments" -c "CHECKPOINT"; }
settle
for round in $(seq "$rounds"); do
  for c in 1 8 32 64; do
    say "round $round: new payments at concurrency $c"
    pgb pay new "$c" 0 "$round" -D "accounts=$accounts"
    http new "$c" 0 "$round"
    if [ "$c" -ge 32 ]; then http new "$c" 0 "$round" "oncepay pool $alt_pool" "$alt_url" "${pids[3]}"; fi
  done
  say "round $round: replays, three instances, hot account, keyless, one key"
  pgb replay replay 32 0 "$round" -D "replay_keys=$replay_keys" -D account=0
  http replay 32 0 "$round"
  http new 32 0 "$round" "oncepay x3" "$three" "$all_pids"
  http replay 32 0 "$round" "oncepay x3" "$three" "$all_pids"
  pgb pay hot 32 0 "$round" -D accounts=1
  http hot 32 0 "$round"
  http keyless 32 0 "$round"
  http one-key 50 0 "$round"
  http one-key 50 0 "$round" "oncepay x3" "$three" "$all_pids"
done

growth() { # rows
  for round in $(seq "$rounds"); do
    say "round $round: $1 key rows"
    pgb pay new 32 "$1" "$round" -D "accounts=$accounts"
    http new 32 "$1" "$round"
    pgb replay replay 32 "$1" "$round" -D "replay_keys=$replay_keys" -D account=0
    http replay 32 "$1" "$round"
  done
}

say "filling $small key rows older than the retention"
sql -v tenant="$tenant" -v rows="$small" -v age='8 days' -f bench/sql/fill_keys.sql
settle
growth "$small"

say "purging $small key rows under load"
purge_started=$(date +%s%N)
"$bin" purge >"$out/purge.txt" 2>/dev/null &
purge_pid=$!
pids+=("$purge_pid")
"$lg" http --urls "$one" --pids "${pids[0]}" --api-key "$api_key" --clock-ticks "$clk" --scenario new \
  --concurrency 32 --duration-secs 300 --while-pid "$purge_pid" --key-rows "$small" \
  --accounts "$accounts" --note "purge of $small rows running" >>"$results"
wait "$purge_pid"
pids=("${pids[@]:0:4}")
echo "milliseconds: $((($(date +%s%N) - purge_started) / 1000000))" >>"$out/purge.txt"

say "filling $big key rows"
sql -v tenant="$tenant" -v rows="$big" -v age='0 days' -f bench/sql/fill_keys.sql
settle
growth "$big"

say "report"
target/release/oncepay-bench-report --input "$results" --machine "$out/machine.txt" --out "$out" --font "$font"
say "done: $out/REPORT.md"
