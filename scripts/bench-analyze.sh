#!/usr/bin/env bash
# `make bench-analyze` (about 3 minutes): where PostgreSQL's CPU per oncepay payment and replay
# goes, against the yardstick's (bench/yardstick). No HTTP: pgbench runs oncepay's own
# statements (bench/sql/pay.sql, replay.sql) and the yardstick's, one after the other, on a
# cluster of its own started with pg_stat_statements (track = all: nested statements too) and
# auto_explain preloaded, which the bench's cluster must not carry (they cost CPU per statement).
#
# For each of the four cases it writes to $ANALYZE_OUT (target/bench-analyze):
#   <case>.json   the load generator's record (throughput, PostgreSQL CPU per transaction)
#   <case>.pgss   pg_stat_statements: every statement, nested ones included, by total time
#   <case>.perf   perf's flat profile of the postgres processes (if perf is installed and allowed)
# and plans.txt: auto_explain's plans (ANALYZE, BUFFERS) of every nested statement of one call.
# docs/bench/analysis.md reads them.
#
# The cluster listens on ANALYZE_PG_PORT (default ONCEPAY_PG_PORT + 2, as + 1 is the chaos
# cluster's default) with its data in a folder of its own, and is stopped at the end.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
cd "$top"

yard="${BENCH_YARDSTICK:-bench/yardstick}"
[ -f "$yard/schema.sql" ] || { echo "bench-analyze: the yardstick is missing: no $yard/schema.sql (set BENCH_YARDSTICK)" >&2; exit 1; }
yard="$(cd "$yard" && pwd)"
secs="${ANALYZE_SECS:-10}"
c="${ANALYZE_CONCURRENCY:-32}"
out="${ANALYZE_OUT:-target/bench-analyze}"
export ONCEPAY_PG_PORT="${ANALYZE_PG_PORT:-$((${ONCEPAY_PG_PORT:-25130} + 2))}"
if [ "$(id -u)" = 0 ]; then
  export ONCEPAY_PGDATA="${ANALYZE_PGDATA:-/var/tmp/oncepay-analyze-pg-$(printf '%s' "$top" | sha256sum | cut -c1-12)}"
else
  export ONCEPAY_PGDATA="${ANALYZE_PGDATA:-$top/.pgdata-analyze}"
fi
mkdir -p "$out"
say() { echo "bench-analyze: $(date +%T) $*" >&2; }

scripts/db.sh up
bindir="$(scripts/db.sh bindir)"
admin_url="$(scripts/db.sh url postgres)"
cleanup() { scripts/db.sh down || true; }
trap cleanup EXIT
apsql() { psql -X -q -v ON_ERROR_STOP=1 -tA "$@"; }
if ! apsql "$admin_url" -c "SHOW shared_preload_libraries" | grep -q 'pg_stat_statements, auto_explain'; then
  say "preloading pg_stat_statements and auto_explain (restart)"
  apsql "$admin_url" -c "ALTER SYSTEM SET shared_preload_libraries = pg_stat_statements, auto_explain"
  scripts/db.sh down
  scripts/db.sh up
fi
# Known only once the library is loaded; a reload is enough for it.
apsql "$admin_url" -c "ALTER SYSTEM SET pg_stat_statements.track = 'all'" -c "SELECT pg_reload_conf()" >/dev/null
pg_pid="$(head -n 1 "$ONCEPAY_PGDATA/postmaster.pid")"
clk="$(getconf CLK_TCK)"

# BENCH_NO_BUILD=1 uses the release binaries as they are (e.g. while another cargo holds the lock).
[ "${BENCH_NO_BUILD:-0}" = 1 ] || SQLX_OFFLINE=true cargo build --release --locked -p oncepay -p oncepay-bench --quiet
bin=target/release/oncepay
lg=target/release/oncepay-loadgen

say "databases oncepay_analyze and oncepay_analyze_yardstick"
url="$(scripts/db.sh url oncepay_analyze)"
yurl="$(scripts/db.sh url oncepay_analyze_yardstick)"
apsql "$admin_url" -c "DROP DATABASE IF EXISTS oncepay_analyze WITH (FORCE)" -c "CREATE DATABASE oncepay_analyze" \
  -c "DROP DATABASE IF EXISTS oncepay_analyze_yardstick WITH (FORCE)" -c "CREATE DATABASE oncepay_analyze_yardstick"
DATABASE_URL="$url" "$bin" migrate 2>/dev/null
tenant="$(DATABASE_URL="$url" "$bin" tenant create --name analyze 2>/dev/null | sed -n 's/.*"tenant_id":"\([^"]*\)".*/\1/p')"
# 10,000 accounts and 10,000 finished keys, made by oncepay's own function, as the bench does.
fp="$(apsql "$url" -c "SELECT encode(sha256('analyze'::bytea), 'hex')")"
apsql "$url" -c "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance)
                 SELECT '$tenant', g::text, 1000000000000, 1000000000000 FROM generate_series(0, 9999) g" \
  -c "SELECT count(*) FROM generate_series(0, 9999) g,
        LATERAL oncepay_pay('$tenant', ROW((1000000000 + g)::text, false, '\\x$fp'::bytea, 'pay', 'POST', '/payments', 86400, 5000, 201, '{\"insufficient_funds\": 402, \"account_not_found\": 404}')::oncepay_claim_args, '0', 1)" >/dev/null
apsql "$yurl" -v accounts=10000 -v replay_keys=100 -f "$yard/schema.sql" >/dev/null
# 10,000 finished keys in the yardstick too (see scripts/bench.sh: with 100 the planner may
# cache a sequential scan for pay_once's key UPDATE).
apsql "$yurl" -c "SELECT count(*) FROM generate_series(1, 10000) i,
        LATERAL pay_once(1, 'seed-' || i, sha256(('seed-' || i)::bytea), 'u' || (1 + i % 10000), 1)" >/dev/null
for d in "$url" "$yurl"; do
  apsql "$d" -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" -c "VACUUM ANALYZE" -c "CHECKPOINT"
done

perf_ok=0
if command -v perf >/dev/null 2>&1 && perf record -e cpu-clock -o "$out/perf.probe" -- true >/dev/null 2>&1; then perf_ok=1; fi
rm -f "$out/perf.probe"

# case side database script scenario [-D ...]
measure() {
  local case="$1" side="$2" db="$3" script="$4" scenario="$5" threads=1 pgopts perf_pid=""
  shift 5
  # As in make bench: oncepay's statements carry its connections' session settings.
  pgopts="-c lock_timeout=5000ms -c statement_timeout=15000ms -c idle_in_transaction_session_timeout=60s"
  if [ "$side" = yardstick ]; then threads=2; pgopts=""; fi
  say "$case: $c clients, $secs s"
  apsql "$db" -c "SELECT pg_stat_statements_reset()" >/dev/null
  if [ "$perf_ok" = 1 ]; then
    perf record -e cpu-clock -F 999 -a -o "$out/$case.perf.data" -- sleep "$secs" >/dev/null 2>&1 &
    perf_pid=$!
  fi
  "$lg" pgbench --side "$side" --threads "$threads" --pgbench "$bindir/pgbench" --pgoptions="$pgopts" \
    --database-url "$db" --script "$script" --scenario "$scenario" --concurrency "$c" --duration-secs "$secs" \
    --clock-ticks "$clk" --pg-pid "$pg_pid" "$@" >"$out/$case.json"
  apsql "$db" -F ' | ' -P footer=off -c "
    SELECT calls, round(total_exec_time::numeric, 1) AS total_ms, round(mean_exec_time::numeric, 4) AS mean_ms,
           rows, shared_blks_hit AS hit, shared_blks_dirtied AS dirtied, wal_records, wal_bytes,
           regexp_replace(query, '\\s+', ' ', 'g') AS query
      FROM pg_stat_statements
     WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
     ORDER BY total_exec_time DESC LIMIT 25" >"$out/$case.pgss"
  if [ -n "$perf_pid" ]; then
    wait "$perf_pid" || true
    # Percentages of the postgres processes' samples only (other work shares the machine).
    {
      perf report -i "$out/$case.perf.data" --stdio --comms postgres --percentage relative --sort dso 2>/dev/null \
        | grep -E '^# Samples|^ ' | head -n 12
      echo
      perf report -i "$out/$case.perf.data" --stdio --comms postgres --percentage relative --sort dso,sym \
        --percent-limit 0.4 2>/dev/null | grep -v '^#' | grep -v '^$' | head -n 70
    } >"$out/$case.perf" || true
    rm -f "$out/$case.perf.data" "$out/$case.perf.data.old"
  fi
}

common=(-D "tenant=$tenant" -D derived=false -D "fp=\\x$fp" -D window=86400 -D amount=1)
measure yardstick-new yardstick "$yurl" "$yard/pay_one.sql" new -D accounts=10000
measure oncepay-new pgbench "$url" bench/sql/pay.sql new "${common[@]}" -D accounts=10000
measure yardstick-replay yardstick "$yurl" "$yard/replay.sql" replay -D replay_keys=100
measure oncepay-replay pgbench "$url" bench/sql/replay.sql replay "${common[@]}" -D replay_keys=10000 -D account=0

say "auto_explain of one call each (plans.txt)"
# Each statement runs three times first (plpgsql compiles, plans are cached), then once more
# explained: the durations are a warm call's.
explain() { # title database statement (with %s where a fresh key number goes)
  echo "===== $1"
  psql -X -q "$2" 2>&1 <<SQL
\\o /dev/null
$(printf "$3\n" 1 2 3)
SET client_min_messages = log;
SET auto_explain.log_level = log;
SET auto_explain.log_min_duration = 0;
SET auto_explain.log_analyze = on;
SET auto_explain.log_buffers = on;
SET auto_explain.log_nested_statements = on;
$(printf "$3\n" 4)
SQL
}
{
  explain "oncepay new payment (oncepay_pay)" "$url" \
    "SELECT * FROM oncepay_pay('$tenant', ROW('explain-new-%s', false, '\\\\x$fp'::bytea, 'pay', 'POST', '/payments', 86400, 5000, 201, '{\"insufficient_funds\": 402, \"account_not_found\": 404}')::oncepay_claim_args, '17', 1);"
  explain "oncepay replay (oncepay_pay of a finished key)" "$url" \
    "SELECT * FROM oncepay_pay('$tenant', ROW('100000000%s', false, '\\\\x$fp'::bytea, 'pay', 'POST', '/payments', 86400, 5000, 201, '{\"insufficient_funds\": 402, \"account_not_found\": 404}')::oncepay_claim_args, '0', 1);"
  explain "yardstick new payment (pay_once)" "$yurl" \
    "SELECT * FROM pay_once(1, 'explain-new-%s', sha256('x'::bytea), 'u17', 1);"
  explain "yardstick replay (SELECT)" "$yurl" \
    "SELECT status, resource_id, error_code, fingerprint, expires_at FROM idempotency_keys WHERE tenant_id = 1 AND key = 'replay-%s';"
} >"$out/plans.txt"

say "summary"
for f in yardstick-new oncepay-new yardstick-replay oncepay-replay; do
  sed -n 's/.*"throughput":\([0-9.]*\).*"pg_cpu_secs_per_request":\([0-9.e-]*\).*"client_cpu_secs_per_request":\([0-9.e-]*\).*/\1 \2 \3/p' "$out/$f.json" |
    awk -v n="$f" '{ printf "%-18s %9.0f tx/s   PostgreSQL %.4f ms/tx   pgbench %.4f ms/tx\n", n, $1, $2 * 1000, $3 * 1000 }'
done | tee "$out/summary.txt"
say "done: $out"
