#!/usr/bin/env bash
# `make callgrind` (about 3 minutes): the release server's own CPU per request as instructions
# counted by valgrind's callgrind, which unlike time repeats within a percent or two on a noisy
# shared machine: compare a change's figures before and after it.
#
# The server (RUST_LOG=warn, as in make bench) runs under callgrind against a database of its
# own (oncepay_callgrind on the local cluster, port ONCEPAY_PG_PORT). After a warm-up (the
# replay keys are made by real payments), the counters are zeroed, CALLGRIND_REQUESTS new
# payments are sent (CALLGRIND_CONCURRENCY at a time) and the counters dumped; then as many
# replays, dumped again, then as many first pages of GET /payments (100 payments each).
# Instructions per request = the dump's total / the requests answered.
# Writes target/callgrind/{new,replay,list}.out (open with callgrind_annotate or kcachegrind),
# their top functions (*.top) and summary.txt.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
cd "$top"

n="${CALLGRIND_REQUESTS:-1000}"
c="${CALLGRIND_CONCURRENCY:-4}"
port="${CALLGRIND_PORT:-18141}"
db="${CALLGRIND_DB:-oncepay_callgrind}"
out="${CALLGRIND_OUT:-target/callgrind}"
say() { echo "callgrind: $(date +%T) $*" >&2; }

if ! command -v valgrind >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing valgrind"
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >&2
  else
    echo "callgrind: valgrind is not installed (e.g. sudo apt-get install -y valgrind)" >&2
    exit 1
  fi
fi

scripts/db.sh up
url="$(scripts/db.sh url "$db")"
admin_url="$(scripts/db.sh url postgres)"
# BENCH_NO_BUILD=1 uses the release binaries as they are (e.g. while another cargo holds the lock).
[ "${BENCH_NO_BUILD:-0}" = 1 ] || SQLX_OFFLINE=true cargo build --release --locked -p oncepay -p oncepay-bench --quiet
bin="${CALLGRIND_BIN:-target/release/oncepay}"  # another build: compare before and after
lg=target/release/oncepay-loadgen
rm -rf "$out" && mkdir -p "$out"

server=""
cleanup() {
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  psql -X -q "$admin_url" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

psql -X -q "$admin_url" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db" >/dev/null
export DATABASE_URL="$url"
"$bin" migrate 2>/dev/null
tenant_json="$("$bin" tenant create --name callgrind 2>/dev/null)"
tenant="$(sed -n 's/.*"tenant_id":"\([^"]*\)".*/\1/p' <<<"$tenant_json")"
api_key="$(sed -n 's/.*"api_key":"\([^"]*\)".*/\1/p' <<<"$tenant_json")"
psql -X -q -v ON_ERROR_STOP=1 "$url" -c "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance)
  SELECT '$tenant', g::text, 1000000000000, 1000000000000 FROM generate_series(0, 9999) g"

say "server under callgrind on 127.0.0.1:$port"
RUST_LOG=warn ONCEPAY_BIND="127.0.0.1:$port" ONCEPAY_METRICS_BIND="127.0.0.1:$((port + 1000))" valgrind --tool=callgrind --vgdb=yes \
  --callgrind-out-file="$top/$out/callgrind.out.%p" "$bin" serve 2>"$out/valgrind.log" &
server=$!
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/readyz" >/dev/null && break; sleep 0.2; done
curl -sf "http://127.0.0.1:$port/readyz" >/dev/null || { tail -n 20 "$out/valgrind.log" >&2; exit 1; }

load() { # scenario [args...]
  local scenario="$1"
  shift
  "$lg" http --urls "http://127.0.0.1:$port" --api-key "$api_key" --scenario "$scenario" --concurrency "$c" \
    --duration-secs 600 "$@"
}
say "warm-up: $n replay keys made by new payments, $n replays"
load seed --replay-keys "$n" >/dev/null
load replay --replay-keys "$n" --requests "$n" >/dev/null

# phase scenario: zero the counters, send n requests, dump; prints the instructions per request.
phase() {
  local name="$1" scenario="$2" record answered ir
  callgrind_control -z "$server" >/dev/null
  record="$(load "$scenario" --replay-keys "$n" --requests "$n")"
  callgrind_control -d "$name" "$server" >/dev/null
  answered="$(sed -n 's/.*"requests":\([0-9]*\).*/\1/p' <<<"$record")"
  [ "${answered:-0}" -gt 0 ] || { echo "callgrind: no $scenario request answered: $record" >&2; exit 1; }
  local dump
  dump="$(grep -l "^desc: Trigger: .*[ :]$name\$" "$out"/callgrind.out.* | head -n 1)"
  [ -n "$dump" ] || { echo "callgrind: no dump named $name in $out" >&2; exit 1; }
  mv "$dump" "$out/$name.out"
  ir="$(sed -n 's/^summary: \([0-9]*\).*/\1/p; s/^totals: \([0-9]*\).*/\1/p' "$out/$name.out" | head -n 1)"
  callgrind_annotate --threshold=100 --auto=no "$out/$name.out" 2>/dev/null | sed -n 20,80p >"$out/$name.top" || true
  echo "$name: $answered requests (errors: $(sed -n 's/.*"errors":\([0-9]*\).*/\1/p' <<<"$record")), $ir instructions, $((ir / answered)) instructions per request"
}
{
  echo "oncepay $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (modified)'), $(date -u '+%Y-%m-%d %H:%M UTC'), concurrency $c"
  phase new new
  phase replay replay
  # The tenant now holds 2n payments (the warm-up's and the new phase's): a first page of 100.
  phase list list-first
} | tee "$out/summary.txt"
say "done: $out/summary.txt"
