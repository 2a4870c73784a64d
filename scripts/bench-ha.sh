#!/usr/bin/env bash
# `make bench-ha` (root, about 12 minutes): oncepay against the yardstick where production
# runs it, on the Patroni cluster of `make ha` (scripts/ha.sh: three PostgreSQL 15 nodes,
# strict synchronous replication to both standbys, HAProxy), with a network delay between the
# namespaces, and through PgBouncer 1.18 in transaction mode; side by side, alternated, in
# one run. Writes results.jsonl, machine.txt and REPORT.md to $BENCH_OUT (docs/bench/ha) and
# prints one line per target: `target: <name> ratio=<r> goal=<g> met=<yes|no>`.
#
# The delay: every node's PostgreSQL is reached through a relay in its namespace that delays
# each direction by BENCH_HA_DELAY_US (500 µs; ONCEPAY_HA_DELAY_US of scripts/ha.sh, the
# relay is tools/bench's oncepay-delay): standby <-> primary (the replication stream and the
# standbys' flush confirmations) and HAProxy <-> node alike, so a commit waits at least one
# 1 ms round trip for its standbys, and every call from the hub one 1 ms round trip. The
# kernel here has no netem qdisc (CONFIG_NET_SCH_NETEM is not set), hence the relay.
#
# In the hub namespace, beside HAProxy: the three oncepay instances of scripts/ha.sh (replay
# cache on), three more with the cache off (the storm's comparison, and `direct` of the
# pooler steps), one more with the cache off behind PgBouncer (ONCEPAY_DB_POOLER=transaction,
# PgBouncer -> HAProxy -> primary, default_pool_size 16 like the instances' own pools), the
# load generator and pgbench. Every step records the CPU per request of the oncepay
# processes, of the primary's PostgreSQL, of the load generator, and of the standbys,
# relays, HAProxy and PgBouncer; and samples the primary's pg_stat_activity every 25 ms
# (where the step's backends spend their time: CPU, waiting for the standbys (SyncRep), local
# WAL flush, locks, or idle in a transaction waiting for the client's next message).
#
# Environment: BENCH_SECS (per step, default 10), BENCH_ROUNDS (default 2), BENCH_HA_DELAY_US
# (500), BENCH_OUT, BENCH_NOTE. Stops everything it started, and the cluster, on exit.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
cd "$top"
[ "$(id -u)" = 0 ] || { echo "bench-ha: needs root (network namespaces, as make ha)" >&2; exit 1; }

secs="${BENCH_SECS:-10}"
rounds="${BENCH_ROUNDS:-2}"
delay_us="${BENCH_HA_DELAY_US:-500}"
out="${BENCH_OUT:-docs/bench/ha}"
yard="$top/bench/yardstick"
c=32
accounts=10000
replay_keys=10000
storm_passes=5
pgb_port=26600
extra_ports=(26111 26112 26113) # cache off, direct
pooled_port=26114               # cache off, through PgBouncer
default_port=26115              # the default batch slots

SQLX_OFFLINE=true cargo build --release --locked -p oncepay -p oncepay-bench -p oncepay-ha --quiet
# Before the cluster starts: a fresh machine has no PgBouncer (installed from Debian as
# make test-pgbouncer does).
pgbouncer="$(scripts/pgbouncer.sh bin)"
bin="$top/target/release/oncepay"
lg="$top/target/release/oncepay-loadgen"
pg_bin=/usr/lib/postgresql/15/bin
# Batch statements in flight: every instance chooses its own from their latency (src/batch/
# limit.rs; the steps record the limit it settled on), but one pinned at 2, the former
# default, for comparison: a statement here is out for a commit that waits on the network and
# two disks, not for CPU, so two slots left the primary idle between commits
# (docs/bench/ha/analysis.md). BENCH_HA_SLOTS pins every instance instead.
slots="${BENCH_HA_SLOTS:-}"
[ -n "$slots" ] && export ONCEPAY_DB_BATCHES_IN_FLIGHT="$slots"
export ONCEPAY_HA_CHECK_FALL=20
export ONCEPAY_BIN="$bin" ONCEPAY_HA_DELAY_US="$delay_us" ONCEPAY_HA_DELAY_BIN="$top/target/release/oncepay-delay"
eval "$(scripts/ha.sh env)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
results="$out/results.jsonl"
: >"$results"
work="$(mktemp -d /tmp/oncepay-bench-ha.XXXXXX)"
chmod 755 "$work"

# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
pids=()
cleanup() {
  stop_pids
  scripts/ha.sh down >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
say() { echo "bench-ha: $(date +%T) $*" >&2; }
in_hub() { ip netns exec "$ha_ns_hub" "$@"; }

say "the cluster (scripts/ha.sh up), every node behind a ${delay_us} µs relay each way"
scripts/ha.sh up
# ha.sh's healthy is one synchronous standby; measure with both (synchronous_node_count 2).
for i in $(seq 120); do
  scripts/ha.sh status | grep -q 'sync=n[0-9],n[0-9]' && break
  [ "$i" = 120 ] && { echo "bench-ha: the second standby never became synchronous: $(scripts/ha.sh status)" >&2; exit 1; }
  sleep 0.5
done
secret="$(cat "$ha_dir/secret")"
url="postgresql://oncepay:$secret@127.0.0.1:$ha_haproxy_port/oncepay"
# The yardstick as the superuser, as on make bench's cluster (its schema.sql ends with a
# CHECKPOINT).
yurl="postgresql://postgres:$secret@127.0.0.1:$ha_haproxy_port/oncepay_yardstick"
su="postgresql://postgres:$secret@127.0.0.1:$ha_haproxy_port/postgres"
psql_hub() { in_hub psql -X -q -v ON_ERROR_STOP=1 "$@"; }
leader="$(scripts/ha.sh status | sed -n 's/^leader=\(n[0-9]\).*/\1/p')"
[ -n "$leader" ] || { echo "bench-ha: no leader" >&2; exit 1; }
pg_pid="$(head -n 1 "$ha_dir/$leader/data/postmaster.pid")"
standby_pids=()
for n in 1 2 3; do
  [ "n$n" = "$leader" ] || standby_pids+=("$(head -n 1 "$ha_dir/n$n/data/postmaster.pid")")
done

# The measured delay: a `SELECT 1` round trip from the hub through HAProxy (and the relay),
# and the primary's view of its standbys' replay lag.
rtt_ms="$(in_hub "$pg_bin/pgbench" -n -T 3 -c 1 -f <(echo 'SELECT 1;') "$url" 2>/dev/null |
  sed -n 's/^latency average = \([0-9.]*\) ms/\1/p')"
say "round trip hub -> primary (SELECT 1): $rtt_ms ms"

say "tenant with $accounts accounts"
tenant_json="$(in_hub env DATABASE_URL="$url" "$bin" tenant create --name bench 2>/dev/null)"
tenant="$(sed -n 's/.*"tenant_id":"\([^"]*\)".*/\1/p' <<<"$tenant_json")"
api_key="$(sed -n 's/.*"api_key":"\([^"]*\)".*/\1/p' <<<"$tenant_json")"
psql_hub "$url" -c "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance)
  SELECT '$tenant', g::text, 1000000000000, 1000000000000 FROM generate_series(0, $((accounts - 1))) g" >/dev/null

say "yardstick database"
psql_hub "$su" -c "CREATE DATABASE oncepay_yardstick" >/dev/null
psql_hub -v accounts="$accounts" -v replay_keys=100 -d "$yurl" -f "$yard/schema.sql" >/dev/null
psql_hub -d "$yurl" \
  -c "SELECT count(*) FROM generate_series(1, $replay_keys) i,
        LATERAL pay_once(1, 'seed-' || i, sha256(('seed-' || i)::bytea), 'u' || (1 + i % $accounts), 1)" \
  -c "VACUUM ANALYZE" >/dev/null

# The sampler of the primary's pg_stat_activity (in the postgres database, as the superuser):
# per sample, each client backend of the two bench databases that is running a statement or
# idle inside a transaction, by what it waits on. It writes nothing (no transaction id).
psql_hub "$su" >/dev/null <<'SQL'
CREATE OR REPLACE FUNCTION bench_waits(samples int, pause float8)
RETURNS TABLE (db text, ev text, n bigint) LANGUAGE plpgsql AS $$
DECLARE
  dbs text[] := '{}';
  evs text[] := '{}';
BEGIN
  FOR i IN 1 .. samples LOOP
    PERFORM pg_stat_clear_snapshot();
    SELECT dbs || coalesce(array_agg(datname::text), '{}'),
           evs || coalesce(array_agg(CASE WHEN state = 'idle in transaction' THEN 'idle in transaction'
                                          WHEN wait_event IS NULL THEN 'CPU'
                                          ELSE wait_event_type || ':' || wait_event END), '{}')
      INTO dbs, evs
      FROM pg_stat_activity
     WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
       AND state IN ('active', 'idle in transaction') AND datname IN ('oncepay', 'oncepay_yardstick');
    PERFORM pg_sleep(pause);
  END LOOP;
  RETURN QUERY SELECT u.d, u.e, count(*) FROM unnest(dbs, evs) AS u(d, e) GROUP BY u.d, u.e;
END $$;
SQL

say "PgBouncer $("$pgbouncer" --version | head -n 1 | awk '{print $2}') in the hub, transaction mode, in front of HAProxy"
mkdir -p "$work/pgbouncer"
cat >"$work/pgbouncer/pgbouncer.ini" <<CONF
[databases]
oncepay = host=127.0.0.1 port=$ha_haproxy_port user=oncepay password=$secret

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $pgb_port
unix_socket_dir =
auth_type = trust
auth_file = $work/pgbouncer/userlist.txt
admin_users = oncepay
pool_mode = transaction
max_client_conn = 500
default_pool_size = 16
max_db_connections = 50
server_idle_timeout = 60
query_wait_timeout = 30
log_connections = 0
log_disconnections = 0
logfile = $work/pgbouncer/pgbouncer.log
CONF
echo '"oncepay" ""' >"$work/pgbouncer/userlist.txt"
chown -R postgres:postgres "$work/pgbouncer"
# (ip netns exec and setpriv exec what they run: $! is PgBouncer's own PID, as for the
# instances below; a shell function in the background would be a subshell's.)
ip netns exec "$ha_ns_hub" setpriv --reuid=postgres --regid=postgres --init-groups -- "$pgbouncer" \
  "$work/pgbouncer/pgbouncer.ini" >>"$work/pgbouncer/stdout.log" 2>&1 &
pgbouncer_pid=$!
pids+=("$pgbouncer_pid")
pooled_url="postgresql://oncepay@127.0.0.1:$pgb_port/oncepay"
admin_pgb="postgresql://oncepay@127.0.0.1:$pgb_port/pgbouncer"
for i in $(seq 50); do in_hub psql -X -qtA "$admin_pgb" -c 'SHOW VERSION' >/dev/null 2>&1 && break; sleep 0.2; done

# serve PORT [NAME=VALUE ...]: one more oncepay instance in the hub, ready before it returns.
serve() {
  local p="$1" i
  shift
  ip netns exec "$ha_ns_hub" env RUST_LOG=warn DATABASE_URL="$url" ONCEPAY_DB_POOL_SIZE=16 ONCEPAY_BIND="127.0.0.1:$p" \
    ONCEPAY_METRICS_BIND="127.0.0.1:$((p + 1000))" "$@" "$bin" serve 2>>"$work/serve-$p.log" &
  pids+=("$!")
  for i in $(seq 100); do
    in_hub curl -sf "http://127.0.0.1:$p/readyz" >/dev/null && return 0
    sleep 0.2
  done
  echo "bench-ha: the instance on $p never became ready: $(tail -n 2 "$work/serve-$p.log")" >&2
  exit 1
}
for p in "${extra_ports[@]}"; do serve "$p" ONCEPAY_REPLAY_CACHE_ENTRIES=0; done
off_pids=("${pids[@]:1:3}")
serve "$pooled_port" ONCEPAY_REPLAY_CACHE_ENTRIES=0 DATABASE_URL="$pooled_url" ONCEPAY_DB_POOLER=transaction
pooled_pid="${pids[-1]}"
default_slots=2 # the fixed number of statements in flight before the batcher chose it
serve "$default_port" ONCEPAY_DB_BATCHES_IN_FLIGHT="$default_slots"
default_pid="${pids[-1]}"

on_pids=()
for i in 1 2 3; do on_pids+=("$(cat "$ha_dir/pids/oncepay-$i")"); done
u_on=() u_off=()
for p in "${ha_app_ports[@]}"; do u_on+=("http://127.0.0.1:$p"); done
for p in "${extra_ports[@]}"; do u_off+=("http://127.0.0.1:$p"); done
one="${u_on[0]}" one_pid="${on_pids[0]}"
three="$(IFS=,; echo "${u_on[*]}")" three_pids="$(IFS=,; echo "${on_pids[*]}")"
three_off="$(IFS=,; echo "${u_off[*]}")" three_off_pids="$(IFS=,; echo "${off_pids[*]}")"
direct="${u_off[0]}" direct_pid="${off_pids[0]}"
pooled="http://127.0.0.1:$pooled_port"
relay_pids=()
for n in 1 2 3; do relay_pids+=("$(cat "$ha_dir/pids/delay-n$n")"); done
haproxy_pid="$(cat "$ha_dir/pids/haproxy")"
clk="$(getconf CLK_TCK)"

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), nproc $(nproc)"
  echo "memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "kernel: $(uname -r)"
  echo "postgresql: $("$pg_bin/postgres" --version)"
  echo "pgbouncer: $("$pgbouncer" --version | head -n 1)"
  echo "cluster: Patroni 3.1.2, 3 nodes, synchronous_mode_strict, synchronous_node_count 2, synchronous_commit on; leader $leader"
  echo "network: ${delay_us} µs each way between the namespaces (oncepay-delay relay in front of every node's PostgreSQL); SELECT 1 from the hub through HAProxy: $rtt_ms ms"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "mode: ${secs} s per step, $rounds round(s), concurrency $c"
  echo "instances: ONCEPAY_DB_BATCHES_IN_FLIGHT=${slots:-unset (chosen by the batcher)} (one instance pinned at $default_slots, the former default, for comparison), ONCEPAY_DB_POOL_SIZE=16, RUST_LOG=warn"
  echo "yardstick: $(cat "$yard"/*.sql | sha256sum | cut -c1-12) (sha256 of its SQL files)"
  [ -n "${BENCH_NOTE:-}" ] && echo "note: $BENCH_NOTE"
} >"$out/machine.txt"

# CPU ticks (user + system, the reaped children's too) of the processes that a loadgen record
# does not cover: the standbys' clusters (postmaster and live children), the relays, HAProxy,
# PgBouncer.
cpu_snap() {
  python3 - "${standby_pids[*]}" "${relay_pids[*]}" "$haproxy_pid" "$pgbouncer_pid" <<'PY'
import json, os, sys
def stat(pid):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(f[1]), sum(int(x) for x in f[11:15]), sum(int(x) for x in f[11:13])
procs = {}
for p in os.listdir("/proc"):
    if p.isdigit():
        s = stat(p)
        if s:
            procs[int(p)] = s
def tree(pid):
    pid = int(pid)
    own = procs.get(pid, (0, 0, 0))[1]
    return own + sum(s[2] for q, s in procs.items() if s[0] == pid)
groups = dict(zip(["standbys", "relays", "haproxy", "pgbouncer"], sys.argv[1:]))
print(json.dumps({g: sum(tree(p) for p in ps.split()) for g, ps in groups.items()}))
PY
}
pgb_stats() { in_hub psql -X -q --csv "$admin_pgb" -c 'SHOW STATS' 2>/dev/null | grep -E '^(database|oncepay),' || true; }

# measure SAMPLES COMMAND...: runs one step (a loadgen command printing its record) with
# the sampler and the snapshots around it, and appends the record with them to results.jsonl.
measure() {
  local samples="$1" rec
  shift
  local cpu0 cpu1 pgb0 pgb1
  cpu0="$(cpu_snap)" pgb0="$(pgb_stats)"
  in_hub psql -X -qtA --csv "$su" -c "SELECT db, ev, n FROM bench_waits($samples, 0.025)" >"$work/waits.csv" 2>/dev/null &
  local sampler=$!
  rec="$("$@")"
  wait "$sampler" || true
  cpu1="$(cpu_snap)" pgb1="$(pgb_stats)"
  python3 - "$rec" "$cpu0" "$cpu1" "$pgb0" "$pgb1" "$work/waits.csv" "$clk" "$samples" >>"$results" <<'PY'
import csv, io, json, sys
rec = json.loads(sys.argv[1])
c0, c1 = json.loads(sys.argv[2]), json.loads(sys.argv[3])
clk = int(sys.argv[7])
n = max(rec["requests"], 1)
rec["extra_cpu_ms_per_request"] = {g: (c1[g] - c0[g]) / clk / n * 1000 for g in c0}
def stats(text):
    rows = list(csv.DictReader(io.StringIO(text)))
    return rows[0] if rows else None
s0, s1 = stats(sys.argv[4]), stats(sys.argv[5])
if s0 and s1:
    d = {k: int(s1[k]) - int(s0[k]) for k in ("total_xact_count", "total_query_count", "total_xact_time", "total_query_time", "total_wait_time")}
    if d["total_xact_count"] > 0:
        rec["pgbouncer"] = d
waits = {}
for row in csv.reader(open(sys.argv[6])):
    if len(row) == 3:
        waits.setdefault(row[0], {})[row[1]] = int(row[2])
rec["waits"] = waits
rec["wait_samples"] = int(sys.argv[8])
print(json.dumps(rec))
PY
}

http() { # side scenario round urls pids [extra loadgen args...]
  local side="$1" scenario="$2" round="$3" u="$4" p="$5"
  shift 5
  measure $((secs * 40 - 8)) in_hub "$lg" http --side "$side" --urls "$u" --pids "$p" --api-key "$api_key" \
    --clock-ticks "$clk" --pg-pid "$pg_pid" --scenario "$scenario" --concurrency "$c" --duration-secs "$secs" \
    --round "$round" --accounts "$accounts" --replay-keys "$replay_keys" "$@"
}
yardstick() { # script scenario round [-D name=value ...]
  local script="$1" scenario="$2" round="$3"
  shift 3
  measure $((secs * 40 - 8)) in_hub "$lg" pgbench --side yardstick --threads 2 --pgbench "$pg_bin/pgbench" --pgoptions= \
    --database-url "$yurl" --script "$yard/$script.sql" --scenario "$scenario" --concurrency "$c" \
    --duration-secs "$secs" --round "$round" --clock-ticks "$clk" --pg-pid "$pg_pid" "$@"
}
storm() { # round cache(on|off) urls pids [affinity]
  local round="$1" cache="$2" u="$3" p="$4" affinity="${5:-}" prefix="storm-$2${5:-}-$1-"
  local side="oncepay x3 cache $cache" flags=()
  [ -n "$affinity" ] && { side="$side, key affinity"; flags=(--affinity); }
  in_hub "$lg" http --urls "$u" --api-key "$api_key" --scenario storm-seed --concurrency 32 --duration-secs 300 \
    --replay-keys "$replay_keys" --accounts "$accounts" --key-prefix "$prefix" >/dev/null
  measure 120 in_hub "$lg" http --side "$side" --urls "$u" --pids "$p" --api-key "$api_key" --clock-ticks "$clk" \
    --pg-pid "$pg_pid" --scenario storm --concurrency 32 --duration-secs 300 --round "$round" \
    --replay-keys "$replay_keys" --accounts "$accounts" --passes "$storm_passes" --key-prefix "$prefix" "${flags[@]}"
}

say "seeding $replay_keys keys for the replays"
in_hub "$lg" http --urls "$one" --api-key "$api_key" --scenario seed --concurrency 32 --duration-secs 300 \
  --replay-keys "$replay_keys" >/dev/null
psql_hub "postgresql://postgres:$secret@127.0.0.1:$ha_haproxy_port/oncepay" -c "VACUUM (ANALYZE)" -c "CHECKPOINT" >/dev/null

for round in $(seq "$rounds"); do
  say "round $round: new payments, c=$c: yardstick, oncepay, oncepay x3"
  if [ $((round % 2)) = 1 ]; then yardstick pay_one new "$round" -D "accounts=$accounts"; fi
  http oncepay new "$round" "$one" "$one_pid"
  http "oncepay, $default_slots slots (fixed)" new "$round" "http://127.0.0.1:$default_port" "$default_pid"
  http "oncepay x3" new "$round" "$three" "$three_pids"
  if [ $((round % 2)) = 0 ]; then yardstick pay_one new "$round" -D "accounts=$accounts"; fi
  say "round $round: new payments, c=128: yardstick, oncepay"
  if [ $((round % 2)) = 1 ]; then c=128 yardstick pay_one new "$round" -D "accounts=$accounts"; fi
  c=128 http oncepay new "$round" "$one" "$one_pid"
  if [ $((round % 2)) = 0 ]; then c=128 yardstick pay_one new "$round" -D "accounts=$accounts"; fi
  say "round $round: replays: yardstick SELECT, oncepay (cache on)"
  yardstick replay replay "$round" -D replay_keys=100
  # Each seeded key once, unmeasured: the new-payment steps filled the cache (bench.sh says why).
  in_hub "$lg" http --urls "$one" --api-key "$api_key" --scenario warm --concurrency 32 --duration-secs 60 \
    --replay-keys "$replay_keys" >/dev/null
  http oncepay replay "$round" "$one" "$one_pid"
  say "round $round: direct against PgBouncer (cache off), new payments and replays"
  order="direct pgbouncer"
  [ $((round % 2)) = 0 ] && order="pgbouncer direct"
  for scenario in new replay; do
    for side in $order; do
      if [ "$side" = direct ]; then
        http "direct, cache off" "$scenario" "$round" "$direct" "$direct_pid"
      else
        http "pgbouncer, cache off" "$scenario" "$round" "$pooled" "$pooled_pid"
      fi
    done
  done
  say "round $round: retry storm, $replay_keys keys x $storm_passes over three instances"
  storm "$round" on "$three" "$three_pids"
  storm "$round" on "$three" "$three_pids" affinity
  storm "$round" off "$three_off" "$three_off_pids"
done
status_line="$(scripts/ha.sh status)"
echo "cluster at the end: $status_line" >>"$out/machine.txt"
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/machine.txt"

say "report"
python3 scripts/bench-ha-report.py "$results" "$out/machine.txt" "$out/REPORT.md"
say "done: $out/REPORT.md"
