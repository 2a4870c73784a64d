#!/usr/bin/env bash
# `make bench` (about 15 minutes) and `make bench-quick` (BENCH_QUICK=1, about 3): oncepay side
# by side with two limits, in alternation so that machine drift hits all sides alike:
#   - pgbench running the very SQL oncepay issues (bench/sql/), which moves when that SQL does;
#   - the yardstick (bench/yardstick): a fixed minimal payment transaction
#     and replay SELECT, loaded into a database of its own on the same cluster.
# Every step records the CPU per request of oncepay, of the whole PostgreSQL cluster and of
# the load generator (oncepay-loadgen or pgbench). A retry storm replays 10,000 finished keys
# over three instances with the replay cache on and off. Card top-ups through oncepay are
# measured against the same processor (localstripe) driven directly. Writes results.jsonl, REPORT.md and
# PNG charts to $BENCH_OUT (docs/bench for the full run, target/bench-quick for the quick one).
# The list steps (docs/api.md, lists) page one tenant's 10 million payments (300,000 quick) against
# pgbench's bare SELECT of the same page, and pay while a client pages through every list.
#
# It builds in release mode, starts the local PostgreSQL if needed (scripts/db.sh, port
# ONCEPAY_PG_PORT), recreates the databases oncepay_bench, oncepay_bench_empty and
# oncepay_yardstick, starts nine oncepay instances on BENCH_PORT.. (RUST_LOG=warn: the
# per-request info line costs CPU that is not oncepay's protocol) and a localstripe
# (scripts/localstripe.sh, on BENCH_PORT + 60), and stops them by pid on exit.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
cd "$top"

yard="${BENCH_YARDSTICK:-bench/yardstick}"
for f in schema.sql pay_one.sql replay.sql; do
  if [ ! -f "$yard/$f" ]; then
    echo "bench: the yardstick is missing: no $yard/$f (BENCH_YARDSTICK names its folder; default bench/yardstick)" >&2
    exit 1
  fi
done
yard="$(cd "$yard" && pwd)"

quick="${BENCH_QUICK:-0}"
if [ "$quick" = 1 ]; then
  secs=2; rounds=1; small=100000; big=300000; list_rows=300000; out="${BENCH_OUT:-target/bench-quick}"
else
  secs=6; rounds=2; small=1000000; big=10000000; list_rows=10000000; out="${BENCH_OUT:-docs/bench}"
fi
port="${BENCH_PORT:-18131}"
db="${BENCH_DB:-oncepay_bench}"
ydb="${BENCH_YARDSTICK_DB:-oncepay_yardstick}"
# An empty key table measured next to the largest one (growth, below).
edb="${db}_empty"
# One tenant with list_rows payments, for the list steps (below), paged at list_c.
ldb="${db}_lists"
list_c=8
replay_keys=10000
accounts=10000
# The retry storm replays each of its 10,000 keys this many times.
storm_passes="$([ "$quick" = 1 ] && echo 2 || echo 5)"

font=/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
if [ ! -f "$font" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "bench: installing fonts-dejavu-core for the charts' text" >&2
  apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fonts-dejavu-core >&2
fi
scripts/db.sh up
bindir="$(scripts/db.sh bindir)"
url="$(scripts/db.sh url "$db")"
yurl="$(scripts/db.sh url "$ydb")"
admin_url="$(scripts/db.sh url postgres)"
# The yardstick at c=512 (pgbench: a connection per client) needs more than the 300
# connections the local cluster is made with (scripts/db.sh): raised once, kept.
if [ "$(psql -X -tA "$admin_url" -c 'SHOW max_connections')" -lt 700 ]; then
  echo "bench: raising the local cluster's max_connections to 700 (a restart)" >&2
  psql -X -q "$admin_url" -c "ALTER SYSTEM SET max_connections = 700" >/dev/null
  scripts/db.sh down >/dev/null
  scripts/db.sh up
fi
# The cluster's postmaster: the CPU of all its processes is charged to each step.
pg_pid="$(head -n 1 "$(scripts/db.sh datadir)/postmaster.pid")"
SQLX_OFFLINE=true cargo build --release --locked -p oncepay -p oncepay-bench --quiet
# Where cargo put them (CARGO_TARGET_DIR, when set, as the Makefile's other targets honour it).
tdir="${CARGO_TARGET_DIR:-target}"
bin="$tdir/release/oncepay"
lg="$tdir/release/oncepay-loadgen"
mkdir -p "$out" target
results="$out/results.jsonl"
: >"$results"

# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
pids=()
stripe_dir="$PWD/target/bench-localstripe"
cleanup() {
  stop_pids
  scripts/localstripe.sh stop "$stripe_dir"
  psql -X -q "$admin_url" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "DROP DATABASE IF EXISTS $ydb WITH (FORCE)" \
    -c "DROP DATABASE IF EXISTS $edb WITH (FORCE)" -c "DROP DATABASE IF EXISTS $ldb WITH (FORCE)" >/dev/null 2>&1 || true
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
  echo "yardstick: $(cat "$yard"/*.sql | sha256sum | cut -c1-12) (sha256 of its SQL files)"
  echo "lists: $list_rows payments of one tenant (the list steps' pages, c=$list_c)"
  [ -n "${BENCH_NOTE:-}" ] && echo "note: $BENCH_NOTE"
} >"$out/machine.txt"

say "database $db"
bench_database "$admin_url" "$url" "$bin" "$accounts"
# A second tenant, the quiet one of the noisy-neighbour steps (docs/scaling.md, batches and tenants).
main_tenant="$tenant" main_api_key="$api_key"
bench_tenant "$url" "$bin" "$accounts" quiet
quiet_api_key="$api_key"
# Two more for the webhook steps: one with an endpoint subscribed to every event, one without.
bench_tenant "$url" "$bin" "$accounts" plain
plain_api_key="$api_key"
bench_tenant "$url" "$bin" "$accounts" hooked
hooked_api_key="$api_key"
# And two for the fair-shares steps (docs/webhooks.md, fair shares): one endpoint that answers at once, ten that
# answer after 2 s.
bench_tenant "$url" "$bin" "$accounts" fair
fair_tenant="$tenant" fair_api_key="$api_key"
bench_tenant "$url" "$bin" "$accounts" slowpoke
slowpoke_tenant="$tenant" slowpoke_api_key="$api_key"
tenant="$main_tenant" api_key="$main_api_key"
export DATABASE_URL="$url"
# No instance delivers webhooks but the deliverer that webhook_steps starts and stops (to the
# sink on 127.0.0.1, hence private targets allowed): the outbox's cost to the payments and the
# delivery's are measured apart, and no step pays for another's deliveries.
ONCEPAY_WEBHOOK_SECRET_KEY="$(head -c 32 /dev/urandom | base64)"
export ONCEPAY_WEBHOOK_SECRET_KEY ONCEPAY_WEBHOOK_ALLOW_PRIVATE=1 ONCEPAY_WEBHOOK_CONCURRENCY=0

say "yardstick database $ydb"
psql -X -q "$admin_url" -c "SET client_min_messages = warning" -c "DROP DATABASE IF EXISTS $ydb WITH (FORCE)" \
  -c "CREATE DATABASE $ydb" >/dev/null
psql -X -q -v ON_ERROR_STOP=1 -v accounts="$accounts" -v replay_keys=100 -d "$yurl" -f "$yard/schema.sql" >/dev/null
# As many finished keys as oncepay's table gets from the seeding below, made by its own
# pay_once, then analysed: with its 100 keys alone the planner sees a two-page key table and
# may cache a sequential scan for pay_once's key UPDATE, whose cost then grows with every
# payment of the step (seen in make bench-analyze: 35 buffers per call instead of 5).
psql -X -q -v ON_ERROR_STOP=1 -d "$yurl" \
  -c "SELECT count(*) FROM generate_series(1, $replay_keys) i,
        LATERAL pay_once(1, 'seed-' || i, sha256(('seed-' || i)::bytea), 'u' || (1 + i % $accounts), 1)" \
  -c "VACUUM ANALYZE" >/dev/null

# start N [NAME=VALUE ...]: instance N on port + N, ready before it returns. Its port may be
# held for a minute by a client connection's local end (ports above 32768 are also the kernel's
# ephemeral ones): a failed bind is retried for up to a minute.
start() {
  local i="$1" u="http://127.0.0.1:$((port + $1))" pid
  shift
  for _ in $(seq 30); do
    env RUST_LOG=warn ONCEPAY_BIND="127.0.0.1:$((port + i))" ONCEPAY_METRICS_BIND="127.0.0.1:$((port + i + 1000))" "$@" "$bin" serve 2>>target/bench-server.log &
    pid=$!
    for _ in $(seq 100); do
      curl -sf "$u/readyz" >/dev/null && { pids+=("$pid"); return; }
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    echo "bench: $u did not start ($(tail -n 1 target/bench-server.log)); retrying" >&2
    sleep 2
  done
  echo "bench: $u never became ready" >&2
  exit 1
}
urls=()
for i in 0 1 2; do
  start "$i"
  urls+=("http://127.0.0.1:$((port + i))")
done
# A fourth instance differs only in its pool size: the pool decides how many commits reach
# PostgreSQL at once (group commit), so the bench measures the default against a larger one.
alt_pool="${BENCH_ALT_POOL:-64}"
start 3 ONCEPAY_DB_POOL_SIZE="$alt_pool"
alt_url="http://127.0.0.1:$((port + 3))"
# Three more with the replay cache off, for the retry storm's comparison.
off_urls=()
for i in 4 5 6; do
  start "$i" ONCEPAY_REPLAY_CACHE_ENTRIES=0
  off_urls+=("http://127.0.0.1:$((port + i))")
done
# The webhook sink (answers 200 to everything) and the hooked tenant's endpoint on it.
sink_port=$((port + 50))
"$lg" sink --port "$sink_port" 2>>target/bench-server.log &
pids+=("$!")
curl -sf -X POST "${urls[0]}/webhook-endpoints" -H "Authorization: Bearer $hooked_api_key" \
  -H "Idempotency-Key: bench-endpoint" -H 'Content-Type: application/json' \
  -d "{\"url\": \"http://127.0.0.1:$sink_port/hooks\"}" >/dev/null \
  || { echo "bench: the webhook endpoint could not be registered" >&2; exit 1; }
# The fair-shares steps' endpoints: the fair tenant's on the same sink, the slowpoke's ten on
# a sink that answers after 2 s.
slow_sink_port=$((port + 52))
"$lg" sink --port "$slow_sink_port" --delay-ms 2000 2>>target/bench-server.log &
pids+=("$!")
endpoint() { # api_key idempotency_key sink_port
  curl -sf -X POST "${urls[0]}/webhook-endpoints" -H "Authorization: Bearer $1" \
    -H "Idempotency-Key: $2" -H 'Content-Type: application/json' \
    -d "{\"url\": \"http://127.0.0.1:$3/hooks\", \"events\": [\"payment.succeeded\"]}" >/dev/null \
    || { echo "bench: the webhook endpoint $2 could not be registered" >&2; exit 1; }
}
endpoint "$fair_api_key" fair-endpoint "$sink_port"
for i in $(seq 10); do endpoint "$slowpoke_api_key" "slow-endpoint-$i" "$slow_sink_port"; done
# Card top-ups (docs/top-ups.md): a localstripe of its own and an instance whose processor it is.
stripe_port=$((port + 60)) stripe_url="http://127.0.0.1:$((port + 60))" stripe_key=sk_test_oncepay
stripe_pid="$(scripts/localstripe.sh start "$stripe_port" "$stripe_dir" 2>/dev/null)" \
  || { echo "bench: localstripe did not start ($stripe_dir/localstripe.log)" >&2; exit 1; }
start 8 ONCEPAY_PROCESSOR_URL="$stripe_url" ONCEPAY_PROCESSOR_API_KEY="$stripe_key"
topup_url="http://127.0.0.1:$((port + 8))" topup_pid="${pids[-1]}"
servers=("${pids[@]}")
one="${urls[0]}"
three="$(IFS=,; echo "${urls[*]}")"
three_pids="$(IFS=,; echo "${pids[*]:0:3}")"
all_pids="$three_pids"
three_off="$(IFS=,; echo "${off_urls[*]}")"
three_off_pids="$(IFS=,; echo "${pids[*]:4:3}")"
clk="$(getconf CLK_TCK)"

http() { # scenario concurrency key_rows round [side urls pids] [extra loadgen args...]
  local scenario="$1" c="$2" rows="$3" round="$4" side="${5:-oncepay}" u="${6:-$one}" p="${7:-${pids[0]}}"
  shift 7 2>/dev/null || shift $#
  "$lg" http --side "$side" --urls "$u" --pids "$p" --api-key "$api_key" --clock-ticks "$clk" --pg-pid "$pg_pid" \
    --scenario "$scenario" --concurrency "$c" --duration-secs "$secs" --key-rows "$rows" --round "$round" \
    --accounts "$accounts" --replay-keys "$replay_keys" "$@" >>"$results"
}
# oncepay's connections carry these from their start-up packet (src/db.rs); pgbench's alone
# get them (psql's fills must not inherit the statement timeout).
pgoptions="-c lock_timeout=5000ms -c statement_timeout=15000ms -c idle_in_transaction_session_timeout=60s"
# (http and pgb read `api_key`, `url` and `tenant` when called: `url=... tenant=... pgb ...` runs
# one step on another database, as bash sets such assignments for the function's run only.)
pgb() { # script scenario concurrency key_rows round [-D name=value ...]
  local script="$1" scenario="$2" c="$3" rows="$4" round="$5"
  shift 5
  "$lg" pgbench --pgbench "$bindir/pgbench" --pgoptions="$pgoptions" --database-url "$url" --script "bench/sql/$script.sql" \
    --scenario "$scenario" --concurrency "$c" --duration-secs "$secs" --key-rows "$rows" --round "$round" \
    --clock-ticks "$clk" --pg-pid "$pg_pid" \
    -D "tenant=$tenant" -D derived=false -D "fp=\\x$fp" -D window=86400 -D amount=1 "$@" >>"$results"
}
# The yardstick as its README runs it: -M prepared -j 2, no session settings.
yardstick() { # script scenario round [-D name=value ...]; at concurrency $yc (default 32)
  local script="$1" scenario="$2" round="$3"
  shift 3
  "$lg" pgbench --side yardstick --threads 2 --pgbench "$bindir/pgbench" --pgoptions= --database-url "$yurl" \
    --script "$yard/$script.sql" --scenario "$scenario" --concurrency "${yc:-32}" --duration-secs "$secs" \
    --round "$round" --clock-ticks "$clk" --pg-pid "$pg_pid" "$@" >>"$results"
}
# The adaptive batcher (src/batch/limit.rs): new payments against the yardstick at the same
# concurrency, one instance, its limit on statements in flight chosen from their latency
# (recorded at each step's end). The main loop measures c=8 and c=32; the sweep adds 128 and
# 512, then all four again with the PostgreSQL cluster pinned to half of the host's CPUs
# (taskset on the postmaster, whose new backends inherit it, and on every process it has),
# where the database, not the host, is the bound. Odd rounds run the yardstick first.
halved="PostgreSQL on half the CPUs"
ncpu="$(nproc)"
pin_pg() { # cpu list
  local p
  for p in "$pg_pid" $(pgrep -P "$pg_pid"); do taskset -a -p -c "$1" "$p" >/dev/null 2>&1 || true; done
}
pair() { # round c [note]
  local round="$1" c="$2" note="${3:-}"
  local args=(--note "$note")
  [ -n "$note" ] || args=()
  if [ $((round % 2)) = 1 ]; then yc="$c" yardstick pay_one new "$round" -D "accounts=$accounts" "${args[@]}"; fi
  http new "$c" 0 "$round" oncepay "$one" "${pids[0]}" "${args[@]}"
  if [ $((round % 2)) = 0 ]; then yc="$c" yardstick pay_one new "$round" -D "accounts=$accounts" "${args[@]}"; fi
}
sweep() { # round
  local c
  for c in $sweep_high; do pair "$1" "$c"; done
  pin_pg "0-$(((ncpu + 1) / 2 - 1))"
  for c in $sweep_all; do pair "$1" "$c" "$halved"; done
  pin_pg "0-$((ncpu - 1))"
}
# The retry storm: fresh keys made by real payments over three instances, then every one of
# them replayed storm_passes times by 32 clients, each on another instance than its maker
# (or, with `affinity`, on its maker, as behind a balancer that hashes the Idempotency-Key).
storm() { # round cache(on|off) urls pids [affinity]
  local round="$1" cache="$2" u="$3" p="$4" affinity="${5:-}" prefix="storm-$2${5:-}-$1-"
  local side="oncepay x3 cache $cache" flags=()
  [ -n "$affinity" ] && { side="$side, key affinity"; flags=(--affinity); }
  "$lg" http --urls "$u" --api-key "$api_key" --scenario storm-seed --concurrency 32 --duration-secs 300 \
    --replay-keys "$replay_keys" --accounts "$accounts" --key-prefix "$prefix" >/dev/null
  "$lg" http --side "$side" --urls "$u" --pids "$p" --api-key "$api_key" --clock-ticks "$clk" \
    --pg-pid "$pg_pid" --scenario storm --concurrency 32 --duration-secs 300 --round "$round" \
    --replay-keys "$replay_keys" --accounts "$accounts" --passes "$storm_passes" --key-prefix "$prefix" \
    "${flags[@]}" >>"$results"
}

# The noisy neighbour: a quiet tenant (c=4 over many accounts) alone, and beside the bench
# tenant paying at c=32 on one hot account, on the same instance (one batcher, one pool). Odd
# rounds measure it alone first, even ones last. The report compares the quiet tenant's p99
# beside the noisy one with its p99 alone (tools/bench, summary.rs, QUIET).
quiet_side="quiet tenant, c=4"
noisy_neighbour() { # round
  if [ $(($1 % 2)) = 1 ]; then api_key="$quiet_api_key" http new 4 0 "$1" "$quiet_side" "$one" "${pids[0]}" --note alone; fi
  "$lg" http --urls "$one" --api-key "$api_key" --scenario hot --concurrency 32 \
    --duration-secs "$(awk "BEGIN { print $secs + 2 }")" --accounts "$accounts" >/dev/null &
  local noisy=$!
  sleep 1
  api_key="$quiet_api_key" http new 4 0 "$1" "$quiet_side" "$one" "${pids[0]}" --note "beside a noisy tenant"
  wait "$noisy"
  if [ $(($1 % 2)) = 0 ]; then api_key="$quiet_api_key" http new 4 0 "$1" "$quiet_side" "$one" "${pids[0]}" --note alone; fi
}

# Webhooks (docs/webhooks.md), same instance, same rounds, new payments at c=32 of a tenant with one
# endpoint subscribed to every event and of one without (the report compares them:
# summary.rs, WEBHOOKS_*). Each round runs the pair "without, with (nothing delivering)" and
# then the same pair in reverse order, ABBA: a difference of a few per cent (the outbox's own
# cost) is below what one pair of 6 s steps resolves on a shared machine (single pairs read
# 0.86 to 1.04 for the same build at 08:00 on 2026-12-03), and drift within the round cancels.
#   1. without; then the hooked tenant's payments with no deliverer running: the outbox's own
#      cost to them (its rows written in the payments' transactions);
#   2. a deliverer (instance 9, the only one that delivers) drains that step's backlog: events
#      per second, PostgreSQL's and the deliverer's CPU per event (webhook-delivery.md);
#   3. the hooked tenant's payments again, delivered meanwhile by the deliverer;
#   4. the rest of that backlog drained, the deliverer stopped;
#   5. the hooked tenant's payments with no deliverer running, then without an endpoint;
#   6. that backlog drained as in 2 (a second row of webhook-delivery.md), the deliverer
#      stopped: no other step pays for it.
deliverer_port=$((port + 9))
# The backlog: pending deliveries, and events not yet fanned out to theirs (migrations/V14).
pending() {
  sql -c "SELECT (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending')
                 + (SELECT count(*) FROM webhook_events WHERE awaiting_fan_out)"
}
# Whether anything is pending: two probes of the partial indexes, where pending()'s counts
# read the whole backlog (polled every 0.1 s, they cost the drain's figures 12 to 77 us of
# PostgreSQL CPU per event, measured with pg_stat_statements at 21:45).
drained() {
  [ "$(sql -c "SELECT NOT EXISTS (SELECT FROM webhook_deliveries WHERE state = 'pending')
                      AND NOT EXISTS (SELECT FROM webhook_events WHERE awaiting_fan_out)")" = t ]
}
# Waits (at most two minutes) until no delivery is pending.
wait_drained() {
  local _i
  for _i in $(seq 1200); do drained && return; sleep 0.1; done
}
# CPU ticks of the PostgreSQL cluster (the postmaster and its children) and of one process.
pg_ticks() {
  local t=0 p
  for p in "$pg_pid" $(pgrep -P "$pg_pid"); do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done
  echo "$t"
}
ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
# drain ROUND: starts the deliverer, waits (at most two minutes) until nothing is pending,
# appends the rate and the CPU per event to webhook-delivery.md; leaves the deliverer running.
drain() {
  local before after t0 t1 pg0 pg1 d1 ms
  before="$(pending)" t0="$(date +%s%N)" pg0="$(pg_ticks)"
  start 9 ONCEPAY_WEBHOOK_CONCURRENCY=64
  deliverer_pid="${pids[-1]}"
  wait_drained
  after="$(pending)"
  t1="$(date +%s%N)" pg1="$(pg_ticks)" d1="$(ticks "$deliverer_pid")"
  ms=$(((t1 - t0) / 1000000))
  awk -v r="$1" -v n="$((before - after))" -v left="$after" -v ms="$ms" -v pg="$((pg1 - pg0))" \
      -v d="$d1" -v clk="$clk" 'BEGIN {
    printf "| %d | %d | %d | %.1f | %.0f | %.3f | %.3f |\n", r, n, left, ms / 1000, n / (ms / 1000),
      pg * 1000 / clk / (n > 0 ? n : 1), d * 1000 / clk / (n > 0 ? n : 1) }' >>"$out/webhook-delivery.rows"
}
stop_deliverer() {
  wait_drained
  kill "$deliverer_pid" 2>/dev/null || true
  wait "$deliverer_pid" 2>/dev/null || true
  unset 'pids[-1]'
}
: >"$out/webhook-delivery.rows"
# One step of new payments at c=32 on instance 0, as the tenant of that API key.
wh_step() { # round api_key note
  api_key="$2" http new 32 0 "$1" oncepay "$one" "${pids[0]}" --note "$3"
}
webhook_steps() { # round
  wh_step "$1" "$plain_api_key" "$wh_none"
  wh_step "$1" "$hooked_api_key" "$wh_later"
  drain "$1"
  wh_step "$1" "$hooked_api_key" "$wh_meanwhile"
  stop_deliverer
  wh_step "$1" "$hooked_api_key" "$wh_later"
  wh_step "$1" "$plain_api_key" "$wh_none"
  drain "$1"
  stop_deliverer
}
wh_none="no webhook endpoint"
wh_later="one webhook endpoint, delivered after the step"
wh_meanwhile="one webhook endpoint, delivered meanwhile"
webhook_delivery_report() {
  {
    echo
    echo "## Webhook delivery (one endpoint, a loopback sink, one delivering instance)"
    echo
    echo "The backlog of each step \"$wh_later\" (two a round), drained by a deliverer started after it"
    echo "(ONCEPAY_WEBHOOK_ENDPOINT_CONCURRENCY at its default); time and CPU per delivered event"
    echo "from before the deliverer's start, its start-up included."
    echo
    echo "| round | events delivered | left pending | seconds | events/s | PostgreSQL CPU ms per event | deliverer CPU ms per event |"
    echo "| --- | --- | --- | --- | --- | --- | --- |"
    cat "$out/webhook-delivery.rows"
  } >"$out/webhook-delivery.md"
}

# Card top-ups (docs/top-ups.md): oncepay's POST /accounts/{id}/top-ups (its two processor calls, create
# and confirm, between its phases' transactions; docs/top-ups.md) against the same two calls
# sent to the same localstripe directly (oncepay-loadgen --processor-direct: the same form and
# headers, keep-alive connections as oncepay's client keeps), same concurrency and duration,
# same rounds (odd rounds direct first). localstripe serves one request at a time (one Python
# process, no await inside its handlers), so 8 in flight keep it busy on both sides while
# oncepay's own phases run: fewer would leave it idle for the time oncepay adds to each call,
# more only lengthen its queue. It also writes its whole store to disk after every change, so
# each call costs more as the store grows: each step starts on an emptied store
# (DELETE /_config/data). The report compares the two throughputs (summary.rs, TOP_UPS).
# The steps last at least 4 s: at about 20 top-ups per second, 2 s are 40 of them.
topup_c=8 topup_secs="$(awk "BEGIN { print ($secs < 4) ? 4 : $secs }")"
topup_direct() { # round
  curl -sf -X DELETE "$stripe_url/_config/data" >/dev/null
  "$lg" http --side "localstripe direct" --processor-direct --urls "$stripe_url" --api-key "$stripe_key" \
    --processor-pid "$stripe_pid" --clock-ticks "$clk" --pg-pid "$pg_pid" --scenario top-up --concurrency "$topup_c" \
    --duration-secs "$topup_secs" --round "$1" --accounts "$accounts" --fail-if-mostly-errors >>"$results"
}
topup_oncepay() { # round
  curl -sf -X DELETE "$stripe_url/_config/data" >/dev/null
  secs="$topup_secs" http top-up "$topup_c" 0 "$1" oncepay "$topup_url" "$topup_pid" --processor-pid "$stripe_pid" \
    --fail-if-mostly-errors
}
topup_steps() { # round
  if [ $(($1 % 2)) = 1 ]; then topup_direct "$1"; fi
  topup_oncepay "$1"
  if [ $(($1 % 2)) = 0 ]; then topup_direct "$1"; fi
}

# The outbox after the webhook steps (whose deliverer drained the backlog before it
# stopped), appended to the report. Delivered rows stay until the purge, a retention later.
outbox_row() {
  {
    echo
    echo "## Webhook outbox (after the webhook steps)"
    echo
    echo "| events | deliveries | pending (deliveries, and events awaiting their fan-out) | delivered | attempts | outbox size (events + deliveries + attempts, with indexes) | bytes per event |"
    echo "| --- | --- | --- | --- | --- | --- | --- |"
    sql -F ' | ' -c "SELECT (SELECT count(*) FROM webhook_events), (SELECT count(*) FROM webhook_deliveries),
                             (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending')
                             + (SELECT count(*) FROM webhook_events WHERE awaiting_fan_out),
                             (SELECT count(*) FROM webhook_deliveries WHERE state = 'delivered'),
                             (SELECT count(*) FROM webhook_attempts),
                             pg_size_pretty(pg_total_relation_size('webhook_events') + pg_total_relation_size('webhook_deliveries')
                                            + pg_total_relation_size('webhook_attempts')),
                             (pg_total_relation_size('webhook_events') + pg_total_relation_size('webhook_deliveries')
                              + pg_total_relation_size('webhook_attempts')) / greatest((SELECT count(*) FROM webhook_events), 1)" \
      | sed 's/^/| /; s/$/ |/'
    echo
    echo "Delivered rows are purged once they are older than ONCEPAY_RETENTION_SECS (like key rows):"
    echo "the outbox holds about (events per second x retention x bytes per event); pending rows,"
    echo "the backlog, should stay near 0 while receivers answer."
  } >"$out/outbox.md"
}

say "seeding $replay_keys keys for the replay scenarios"
"$lg" http --urls "$one" --api-key "$api_key" --scenario seed --concurrency 32 --duration-secs 300 \
  --replay-keys "$replay_keys" >/dev/null
fp="$(sql -c "SELECT encode(fingerprint, 'hex') FROM idempotency_keys WHERE tenant_id = '$tenant' AND key = '1000000000'")"
[ -n "$fp" ] || { echo "bench: the seeded keys are missing" >&2; exit 1; }
# The top-up instance, unmeasured, as the seeding warms instance 0: a fresh pool opens its
# connections, and each plans the top-up functions, on first use (the first bench-quick with
# the top-up steps measured its top-ups at 10.75 ms of PostgreSQL CPU each, a warm instance
# 2.5 to 4 by hand). It also fails the bench early if top-ups fail.
say "warming the top-up instance"
"$lg" http --urls "$topup_url" --api-key "$api_key" --scenario top-up --concurrency "$topup_c" --duration-secs 3 \
  --accounts "$accounts" --fail-if-mostly-errors >/dev/null

settle() {
  sql -c "VACUUM (ANALYZE) idempotency_keys" -c "VACUUM (ANALYZE) payments"
  psql -X -q -v ON_ERROR_STOP=1 "$yurl" -c "VACUUM (ANALYZE)" -c "CHECKPOINT"
}
settle
if [ "$quick" = 1 ]; then sweep_high="128"; sweep_all="8 128"; else sweep_high="128 512"; sweep_all="8 32 128 512"; fi
for round in $(seq "$rounds"); do
  for c in 1 8 32 64; do
    say "round $round: new payments at concurrency $c"
    pgb pay new "$c" 0 "$round" -D "accounts=$accounts"
    if [ "$c" = 8 ] || [ "$c" = 32 ]; then
      pair "$round" "$c"
    else
      http new "$c" 0 "$round"
    fi
    if [ "$c" -ge 32 ]; then http new "$c" 0 "$round" "oncepay pool $alt_pool" "$alt_url" "${pids[3]}"; fi
  done
  say "round $round: new payments at concurrency $sweep_high, then $sweep_all with $halved"
  sweep "$round"
  say "round $round: replays, three instances, hot account, keyless, one key"
  pgb replay replay 32 0 "$round" -D "replay_keys=$replay_keys" -D account=0
  yardstick replay replay "$round" -D replay_keys=100
  # The replay target is about replays the cache answers. The new-payment steps since the
  # seed made more keys than the cache holds (LRU), so each seeded key would be read from
  # the database once inside the step (10,000 of ~260,000 at 11:30, all of PostgreSQL's
  # CPU in that step): replay each key once, unmeasured, first. The storm measures the
  # cold case.
  "$lg" http --urls "$one" --api-key "$api_key" --scenario warm --concurrency 32 --duration-secs 60 \
    --replay-keys "$replay_keys" >/dev/null
  http replay 32 0 "$round"
  http new 32 0 "$round" "oncepay x3" "$three" "$all_pids"
  http replay 32 0 "$round" "oncepay x3" "$three" "$all_pids"
  pgb pay hot 32 0 "$round" -D accounts=1
  http hot 32 0 "$round"
  http keyless 32 0 "$round"
  http one-key 50 0 "$round"
  http one-key 50 0 "$round" "oncepay x3" "$three" "$all_pids"
  say "round $round: a quiet tenant alone and beside a noisy one"
  noisy_neighbour "$round"
  # Before the webhook steps, whose events the instances deliver after them (PostgreSQL
  # and oncepay CPU that would compete with localstripe's: 25 ms of PostgreSQL CPU per top-up
  # on both sides when these steps came after them, at 04:01).
  say "round $round: card top-ups at c=$topup_c, through oncepay and at localstripe directly"
  topup_steps "$round"
  say "round $round: new payments with one webhook endpoint and without"
  webhook_steps "$round"
  say "round $round: retry storm, $replay_keys keys x $storm_passes, cache on, then off"
  storm "$round" on "$three" "$three_pids"
  storm "$round" on "$three" "$three_pids" affinity
  storm "$round" off "$three_off" "$three_off_pids"
done
outbox_row
webhook_delivery_report

# Fair shares (docs/webhooks.md, fair shares): the delivery latency of the fair tenant's one endpoint alone, and
# beside the slowpoke tenant, whose ten endpoints answer after 2 s and whose backlog alone
# would take every slot of the deliverer (ten endpoints of 16 in flight each against 64
# slots). A step: the slowpoke's backlog first (beside only: 600 payments, 6,000 deliveries,
# unrecorded, enough to hold its slots for minutes), the deliverer started (instance 9, the
# only one that delivers), the backlog fanned out (its deliveries written) and a second for
# its attempts to fill the slots, then the fair tenant's payments at 100 a second (an open
# load far below what one endpoint takes: a latency, not a throughput, is measured) for the
# step's seconds, then every one of its events delivered. Latency: from the event's time (its
# payment's) to its delivery's record (finished_at), p50 and p99 over the step's events.
# Order alone, beside, beside, alone: drift cancels. Goal: p99 beside <= 2x alone. After a
# step the slowpoke's backlog is cancelled, so nothing else pays for it.
fair_step() { # mode
  local t0 left
  if [ "$1" = beside ]; then
    "$lg" http --urls "$one" --api-key "$slowpoke_api_key" --scenario new --concurrency 8 --duration-secs 30 \
      --requests 600 --accounts "$accounts" >/dev/null
  fi
  start 9 ONCEPAY_WEBHOOK_CONCURRENCY=64
  deliverer_pid="${pids[-1]}"
  for _i in $(seq 600); do
    [ "$(sql -c "SELECT NOT EXISTS (SELECT FROM webhook_events WHERE awaiting_fan_out)")" = t ] && break
    sleep 0.1
  done
  sleep 1
  t0="$(sql -c "SELECT now()")"
  "$lg" http --urls "$one" --api-key "$fair_api_key" --scenario new --concurrency 4 --rate 100 \
    --duration-secs "$secs" --accounts "$accounts" >/dev/null
  for _i in $(seq 600); do
    left="$(sql -c "SELECT (SELECT count(*) FROM webhook_deliveries WHERE tenant_id = '$fair_tenant' AND state = 'pending')
                         + (SELECT count(*) FROM webhook_events WHERE tenant_id = '$fair_tenant' AND awaiting_fan_out)")"
    [ "$left" = 0 ] && break
    sleep 0.1
  done
  sql -F ' | ' -c "SELECT '$1', count(*), $left,
                          round(1000 * percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM d.finished_at - ev.created_at))::numeric, 1),
                          round(1000 * percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM d.finished_at - ev.created_at))::numeric, 1)
                     FROM webhook_deliveries d JOIN webhook_events ev USING (tenant_id, event_id)
                    WHERE d.tenant_id = '$fair_tenant' AND d.state = 'delivered' AND ev.created_at >= '$t0'" \
    | sed 's/^/| /; s/$/ |/' >>"$out/fairness.rows"
  kill "$deliverer_pid" 2>/dev/null || true
  wait "$deliverer_pid" 2>/dev/null || true
  unset 'pids[-1]'
  sql -c "UPDATE webhook_deliveries SET state = 'cancelled', finished_at = now(), leased_until = NULL
           WHERE tenant_id = '$slowpoke_tenant' AND state = 'pending'" \
      -c "UPDATE webhook_events SET awaiting_fan_out = false WHERE tenant_id = '$slowpoke_tenant' AND awaiting_fan_out" >/dev/null
}
: >"$out/fairness.rows"
say "fair shares: one fast endpoint alone and beside a tenant with ten slow ones"
for mode in alone beside beside alone; do fair_step "$mode"; done
{
  echo
  echo "## Fair shares (one fast endpoint, alone and beside a tenant with ten slow endpoints)"
  echo
  echo "The fair tenant pays 100 times a second for ${secs} s; its endpoint answers at once. Beside: the"
  echo "slowpoke tenant's backlog on ten endpoints that answer after 2 s, enough to hold every one of"
  echo "the deliverer's 64 slots for the whole step without fair shares. Latency from the event's time"
  echo "to its delivery's record, in ms."
  echo
  echo "| step | events delivered | left pending | p50 ms | p99 ms |"
  echo "| --- | --- | --- | --- | --- |"
  cat "$out/fairness.rows"
  echo
  awk -F '|' '$2 ~ /alone/ { a += $6; na++ } $2 ~ /beside/ { b += $6; nb++ }
    END { if (na && nb && a > 0) printf "p99 beside / alone: **%.2f** (mean of each pair; goal <= 2: %s)\n",
            (b / nb) / (a / na), ((b / nb) / (a / na) <= 2 ? "met" : "not met") }' "$out/fairness.rows"
} >"$out/fairness.md"

# The largest table's new payments are compared with an empty table's measured next to them,
# in the same round, rather than with the 0-row steps of minutes before: across minutes this
# shared host drifts more than the table costs (the ratio read 0.76 from steps 10 minutes
# apart at 11:42, and 1.03 alternated by hand at 12:31: docs/bench/analysis.md). The empty
# table is a second database, made as the first, with an instance of its own; its steps carry
# this note, which the report looks for (tools/bench/src/bin/oncepay-bench-report/summary.rs, BESIDE).
beside="empty key table, beside the largest"
beside_steps() { # round
  url="$eurl" tenant="$etenant" pgb pay new 32 0 "$1" -D "accounts=$accounts" --note "$beside"
  api_key="$eapi_key" http new 32 0 "$1" oncepay "$eu" "$epid" --note "$beside"
}
growth() { # rows [beside]
  for round in $(seq "$rounds"); do
    say "round $round: $1 key rows${2:+, and an empty table beside}"
    # Odd rounds measure the empty table first, even ones last: neither goes first every time.
    if [ -n "${2:-}" ] && [ $((round % 2)) = 1 ]; then beside_steps "$round"; fi
    pgb pay new 32 "$1" "$round" -D "accounts=$accounts"
    http new 32 "$1" "$round"
    if [ -n "${2:-}" ] && [ $((round % 2)) = 0 ]; then beside_steps "$round"; fi
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
"$lg" http --urls "$one" --pids "${pids[0]}" --api-key "$api_key" --clock-ticks "$clk" --pg-pid "$pg_pid" --scenario new \
  --concurrency 32 --duration-secs 300 --while-pid "$purge_pid" --key-rows "$small" \
  --accounts "$accounts" --note "purge of $small rows running" >>"$results"
wait "$purge_pid"
pids=("${servers[@]}")
echo "milliseconds: $((($(date +%s%N) - purge_started) / 1000000))" >>"$out/purge.txt"

say "filling $big key rows"
sql -v tenant="$tenant" -v rows="$big" -v age='0 days' -f bench/sql/fill_keys.sql
say "database $edb (an empty key table) and its instance"
main_tenant="$tenant" main_api_key="$api_key"
eurl="$(scripts/db.sh url "$edb")"
bench_database "$admin_url" "$eurl" "$bin" "$accounts"
etenant="$tenant" eapi_key="$api_key" tenant="$main_tenant" api_key="$main_api_key"
start 7 DATABASE_URL="$eurl"
eu="http://127.0.0.1:$((port + 7))" epid="${pids[-1]}"
servers=("${pids[@]}")
# A fresh instance's first seconds are slower (its pool fills; 3,756/s against 4,792 and
# 5,115 by hand at 12:31): warm it, unmeasured.
"$lg" http --urls "$eu" --api-key "$eapi_key" --scenario new --concurrency 32 --duration-secs 3 \
  --accounts "$accounts" >/dev/null
psql -X -q -v ON_ERROR_STOP=1 "$eurl" -c "VACUUM (ANALYZE)"
settle
growth "$big" beside

# Lists (docs/api.md, lists), on a database of their own: one tenant with list_rows payments (and a
# tenth as many transfers and events, a hundredth as many top-ups, its 10,000 accounts), so
# that no other step's table grows by them. Per round, alternated (odd rounds pgbench first):
#   1. a page of 100 payments, the first and one deep in the list (the items after the
#      payment halfway through), GET /payments through oncepay at c=8, against the same rows
#      read by a bare indexed SELECT ... LIMIT 100 by pgbench (bench/sql/list_page.sql), given
#      the cursor's (created_at, id): the report compares their p99 (goal <= 1.5);
#   2. that tenant's new payments at c=32, without and with a client (oncepay-loadgen
#      page-lists, one connection) paging through every list meanwhile, ABBA (goal >= 0.9).
list_note="one tenant's payments"
paging_none="lists: no client paging"
paging_meanwhile="lists: a client paging through every list"
lists_setup() {
  local main_tenant="$tenant" main_api_key="$api_key"
  lurl="$(scripts/db.sh url "$ldb")"
  bench_database "$admin_url" "$lurl" "$bin" "$accounts"
  ltenant="$tenant" lapi_key="$api_key" tenant="$main_tenant" api_key="$main_api_key"
  say "filling $list_rows payments of one tenant (and its transfers, top-ups, events)"
  # A payment every quarter of a second, back from now: 10 million over 29 days.
  psql -X -q -v ON_ERROR_STOP=1 "$lurl" \
    -c "INSERT INTO payments (tenant_id, payment_id, account_id, amount, balance_after, created_at)
        SELECT '$ltenant', gen_random_uuid(), (g % $accounts)::text, 1, 1, now() - make_interval(secs => g / 4.0)
          FROM generate_series(1, $list_rows) g" \
    -c "INSERT INTO transfers (tenant_id, transfer_id, from_account_id, to_account_id, amount, from_balance_after,
                               to_balance_after, created_at)
        SELECT '$ltenant', gen_random_uuid(), (g % $accounts)::text, ((g + 1) % $accounts)::text, 1, 1, 1,
               now() - make_interval(secs => g * 2.5)
          FROM generate_series(1, $list_rows / 10) g" \
    -c "INSERT INTO top_ups (tenant_id, top_up_id, account_id, amount, currency, payment_method, status, recovery_point,
                             balance_after, created_at, updated_at, processor)
        SELECT '$ltenant', gen_random_uuid(), (g % $accounts)::text, 100, 'usd', 'pm_card_visa', 'succeeded', 'finished',
               100, now() - make_interval(secs => g * 25), now(), 'bench'
          FROM generate_series(1, $list_rows / 100) g" \
    -c "INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at)
        SELECT '$ltenant', gen_random_uuid(), 'deposit.succeeded', 'bench-' || g, '{}', now() - make_interval(secs => g * 2.5)
          FROM generate_series(1, $list_rows / 10) g" \
    -c "VACUUM (ANALYZE)" -c "CHECKPOINT" >/dev/null
  # The fill's dirty pages (gigabytes, hint bits and the visibility map from the VACUUM) are
  # written by the CHECKPOINT above, as the yardstick's setup does, not by one during the
  # measured steps.
  # The deep page's cursor: the payment halfway through, newest first.
  IFS='|' read -r deep_id deep_at < <(psql -X -qtA "$lurl" -c "SELECT payment_id, created_at FROM payments
      WHERE tenant_id = '$ltenant' ORDER BY created_at DESC, payment_id DESC OFFSET $list_rows / 2 LIMIT 1")
  [ -n "$deep_id" ] || { echo "bench: the lists' deep cursor is missing" >&2; exit 1; }
  start 10 DATABASE_URL="$lurl"
  lu="http://127.0.0.1:$((port + 10))" lpid="${pids[-1]}"
  servers=("${pids[@]}")
  # Warm, unmeasured: the pool's connections and the list's plans.
  "$lg" http --urls "$lu" --api-key "$lapi_key" --scenario list-first --concurrency "$list_c" --duration-secs 2 >/dev/null
  "$lg" http --urls "$lu" --api-key "$lapi_key" --scenario new --concurrency 32 --duration-secs 2 \
    --accounts "$accounts" >/dev/null
}
list_page_steps() { # round scenario cursor_id cursor_at
  local oncepay_args=() pgbench_args=(-D "cursor_at=$4" -D "cursor_id=$3" --note "$list_note")
  [ "$2" = list-deep ] && oncepay_args=(--cursor "$3")
  if [ $(($1 % 2)) = 1 ]; then url="$lurl" tenant="$ltenant" pgb list_page "$2" "$list_c" 0 "$1" "${pgbench_args[@]}"; fi
  api_key="$lapi_key" http "$2" "$list_c" 0 "$1" oncepay "$lu" "$lpid" --note "$list_note" "${oncepay_args[@]}"
  if [ $(($1 % 2)) = 0 ]; then url="$lurl" tenant="$ltenant" pgb list_page "$2" "$list_c" 0 "$1" "${pgbench_args[@]}"; fi
}
paging_step() { # round with_pager
  local pager=""
  if [ "$2" = yes ]; then
    "$lg" http --urls "$lu" --api-key "$lapi_key" --scenario page-lists --concurrency 1 \
      --duration-secs "$(awk "BEGIN { print $secs + 2 }")" >/dev/null &
    pager=$!
    sleep 1
    api_key="$lapi_key" http new 32 0 "$1" oncepay "$lu" "$lpid" --note "$paging_meanwhile"
    wait "$pager"
  else
    api_key="$lapi_key" http new 32 0 "$1" oncepay "$lu" "$lpid" --note "$paging_none"
  fi
}
list_steps() { # round
  list_page_steps "$1" list-first ffffffff-ffff-ffff-ffff-ffffffffffff infinity
  list_page_steps "$1" list-deep "$deep_id" "$deep_at"
  paging_step "$1" no
  paging_step "$1" yes
  paging_step "$1" yes
  paging_step "$1" no
}
lists_setup
for round in $(seq "$rounds"); do
  say "round $round: lists: a page of $list_rows payments, first and deep; payments while a client pages"
  list_steps "$round"
done

say "report"
"$tdir/release/oncepay-bench-report" --input "$results" --machine "$out/machine.txt" --out "$out" --font "$font"
cat "$out/outbox.md" "$out/webhook-delivery.md" "$out/fairness.md" >>"$out/REPORT.md"
# The targets, as the report states them.
sed -n '/^| target |/,/^$/p' "$out/REPORT.md" | grep -v '^| ---' >&2
grep '^p99 beside / alone' "$out/fairness.md" >&2 || true
# A full run's yardstick targets are the README's table of current ratios (its Speed section).
if [ "$quick" != 1 ] && [ "$out" = docs/bench ]; then
  scripts/bench-readme.py "$out/REPORT.md" README.md >&2
fi
say "done: $out/REPORT.md"
