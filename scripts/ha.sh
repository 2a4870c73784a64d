#!/usr/bin/env bash
# `make ha`: a real high-availability PostgreSQL on this machine, three oncepay instances in
# front of it, faults injected under load and the books verified (docs/ha.md).
#
#   scripts/ha.sh run            up, load + faults + verification (oncepay-ha), down; exit status of the check
#   scripts/ha.sh up | down      start / stop everything (down stops by PID and removes the namespaces)
#   scripts/ha.sh status         one line: leader=NAME timeline=N sync=NAME members=...
#   scripts/ha.sh fault NAME     inject a fault: kill-postmaster | switchover | partition |
#                                kill-patroni-postgres | stop-standby
#   scripts/ha.sh recover NAME   undo it (heal, restart what was killed or stopped) and wait until healthy
#   scripts/ha.sh wait-healthy   wait until a writable leader, two streaming standbys, one of them synchronous
#   scripts/ha.sh env            shell assignments of its folder, namespaces and ports (for scripts/bench-ha.sh)
#
# ONCEPAY_HA_DELAY_US=N (make bench-ha): every node's PostgreSQL is reached through a relay in
# its namespace (oncepay-delay, port pg_port + 1) that delays each direction by N µs, and
# that is the address its standbys and HAProxy use: a network delay between the namespaces
# where the kernel has no netem qdisc. ONCEPAY_HA_CHECK_FALL (default 2): failed HAProxy
# checks, 500 ms apart, before a node is marked down and its sessions cut (make bench-ha
# saturates both cores, and a starved Patroni answering its REST API late must not end a
# step: it did at 2).
#
# Topology: network namespaces created here, so that a partition is a real cut of the network.
# A hub namespace holds a bridge, etcd, HAProxy, the three oncepay instances and the load
# driver; each PostgreSQL node (Patroni + PostgreSQL 15) lives in a namespace of its own,
# joined to the bridge by a veth pair. Nothing listens in the host's namespace, and no
# traffic leaves these namespaces. A partition sets the node's bridge port down: the node
# loses etcd, the other nodes and HAProxy at once, and nothing tells it (no RST).
#
# Runs as root (namespaces); PostgreSQL and Patroni run as the `postgres` user (setpriv, so
# the recorded PID is the process itself). Every wait is bounded; `run` stops everything it
# started, by PID, also on failure or Ctrl-C.
set -euo pipefail

top="$(cd "$(dirname "$0")/.." && pwd)"
tag="$(printf '%s' "$top" | sha256sum | cut -c1-8)"
dir="${ONCEPAY_HA_DIR:-/var/tmp/oncepay-ha-$tag}"
net="${ONCEPAY_HA_SUBNET:-10.211.0}" # a /24 that exists only inside the namespaces below
ns_hub="ohub-$tag"
ns_node() { echo "on$1-$tag"; }
nodes=(1 2 3)
pg_port=26432
delay_us="${ONCEPAY_HA_DELAY_US:-}"
delay_bin="${ONCEPAY_HA_DELAY_BIN:-$top/target/release/oncepay-delay}"
# The port the other nodes and HAProxy reach a node's PostgreSQL on: the relay's, if any.
pg_connect_port=$pg_port
[ -n "$delay_us" ] && pg_connect_port=$((pg_port + 1))
rest_port=26008
etcd_port=26379
etcd_peer_port=26380
haproxy_port=26500
haproxy_stats_port=26501
app_ports=(26101 26102 26103)
venv="${ONCEPAY_HA_VENV:-/var/cache/oncepay-ha/patroni-3.1.2}"
patroni_pin="patroni[etcd3]==3.1.2"
bin="${ONCEPAY_BIN:-$top/target/release/oncepay}"
driver="${ONCEPAY_HA_DRIVER:-$top/target/release/oncepay-ha}"
pg_bin="$(ls -d /usr/lib/postgresql/15/bin 2>/dev/null || true)"
scope="oncepay-ha"

log() { echo "ha: $(date -u +%H:%M:%S.%3N) $*" >&2; }
die() { log "$*"; exit 1; }
in_hub() { ip netns exec "$ns_hub" "$@"; }
in_node() { local n="$1"; shift; ip netns exec "$(ns_node "$n")" "$@"; }
node_addr() { echo "$net.1$1"; }

# ---------------------------------------------------------------- packages

ensure_packages() {
  local missing=()
  command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
  command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
  command -v haproxy >/dev/null 2>&1 || missing+=(haproxy)
  [ -x /usr/lib/postgresql/15/bin/postgres ] || missing+=(postgresql-15)
  command -v curl >/dev/null 2>&1 || missing+=(curl)
  command -v jq >/dev/null 2>&1 || missing+=(jq)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  command -v psql >/dev/null 2>&1 || missing+=(postgresql-client-15)
  /usr/bin/python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
  if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]} with apt-get"
    apt-get update -qq >&2
    # No service is started by the packages' maintainer scripts in a container; stop any that was.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
  fi
  pg_bin=/usr/lib/postgresql/15/bin
  if ! "$venv/bin/patroni" --version 2>/dev/null | grep -q '3.1.2'; then
    log "installing Patroni 3.1.2 from PyPI into $venv"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    /usr/bin/python3 -m venv "$venv"
    # ydiff 1.2: patronictl 3.1 imports an API that ydiff 1.3 removed.
    timeout 600 "$venv/bin/pip" install -q "$patroni_pin" 'psycopg[binary]>=3.1,<3.4' 'ydiff==1.2' >&2
  fi
}

# ---------------------------------------------------------------- processes

# start NAME NAMESPACE USER CMD...: runs CMD in the background in NAMESPACE as USER
# (root or postgres), output to logs/NAME.log, PID to pids/NAME.
start() {
  local name="$1" ns="$2" user="$3"
  shift 3
  local wrap=()
  [ "$user" = root ] || wrap=(setpriv --reuid="$user" --regid="$user" --init-groups --)
  ip netns exec "$ns" "${wrap[@]}" "$@" >>"$dir/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$dir/pids/$name"
  disown $! # no job notice when a fault kills it
}

alive() { [ -s "$dir/pids/$1" ] && kill -0 "$(cat "$dir/pids/$1")" 2>/dev/null; }

# stop NAME [SIGNAL]: signals the recorded PID, waits up to 20 s, then SIGKILL.
stop() {
  local name="$1" sig="${2:-TERM}" pid i
  [ -s "$dir/pids/$name" ] || return 0
  pid="$(cat "$dir/pids/$name")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "-$sig" "$pid" 2>/dev/null || true
    for i in $(seq 1 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { log "$name (pid $pid) ignored SIG$sig for 20 s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; }
    for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -f "$dir/pids/$name"
}

postmaster_pid() { head -n 1 "$dir/n$1/data/postmaster.pid" 2>/dev/null || true; }

# A postmaster whose Patroni was killed keeps running; it is ours (its data folder is).
stop_postmaster() {
  local pid i
  pid="$(postmaster_pid "$1")"
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$dir/n$1/data" || return 0
  kill -QUIT "$pid" 2>/dev/null || true # immediate shutdown
  for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

# ---------------------------------------------------------------- network

net_up() {
  net_down
  ip netns add "$ns_hub"
  in_hub ip link set lo up
  in_hub ip link add ohbr type bridge
  in_hub ip addr add "$net.1/24" dev ohbr
  in_hub ip link set ohbr up
  local n
  for n in "${nodes[@]}"; do
    ip netns add "$(ns_node "$n")"
    in_node "$n" ip link set lo up
    ip -n "$ns_hub" link add "ohv$n" type veth peer name eth0 netns "$(ns_node "$n")"
    in_hub ip link set "ohv$n" master ohbr up
    in_node "$n" ip addr add "$(node_addr "$n")/24" dev eth0
    in_node "$n" ip link set eth0 up
  done
}

net_down() {
  local n
  for n in "${nodes[@]}"; do ip netns del "$(ns_node "$n")" 2>/dev/null || true; done
  ip netns del "$ns_hub" 2>/dev/null || true
}

# ---------------------------------------------------------------- configuration

write_patroni_config() {
  local n="$1" addr
  addr="$(node_addr "$n")"
  mkdir -p "$dir/n$n"
  cat >"$dir/n$n/patroni.yml" <<YAML
scope: $scope
name: n$n
log:
  level: INFO
restapi:
  listen: $addr:$rest_port
  connect_address: $addr:$rest_port
etcd3:
  hosts: $net.1:$etcd_port
  protocol: http
bootstrap:
  dcs:
    # Failover timings (docs/ha.md): the leader key lives ttl seconds without a refresh;
    # loop_wait + 2 * retry_timeout <= ttl.
    ttl: 7
    loop_wait: 1
    retry_timeout: 3
    primary_start_timeout: 10
    # A demotion (the leader cut off from etcd, a switchover) may wait at most 1 s for
    # PostgreSQL's fast shutdown before Patroni shuts it down immediately (then SIGKILL after
    # another second): Patroni 3.1.2 starts a second demotion from its main loop when the
    # first one is still pending or running at the next loop; overlapping, both start
    # PostgreSQL, pg_rewind fails and the node never rejoins (docs/ha.md). Safe for
    # durability: a commit is acknowledged only once both standbys have it, whatever happens
    # to the old primary afterwards.
    primary_stop_timeout: 1
    # A commit is acknowledged only once the synchronous standbys have it, and with no
    # synchronous standby the primary blocks commits instead of going asynchronous. Both
    # standbys are synchronous: a failover then promotes the more advanced of them, so the
    # other one follows at once instead of being rewound first (with one synchronous
    # standby, the asynchronous one can be ahead of it and needs pg_rewind, while the new
    # primary blocks commits for want of a standby: 28 s measured; docs/ha.md).
    synchronous_mode: true
    synchronous_mode_strict: true
    synchronous_node_count: 2
    failsafe_mode: false
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        synchronous_commit: "on"
        wal_level: replica
        wal_log_hints: "on"
        hot_standby: "on"
        max_connections: 400
        max_wal_senders: 10
        max_replication_slots: 10
        wal_keep_size: 256MB
        # A primary cut off from its standbys finishes its demotion (a fast shutdown waits
        # for the walsenders) within 2 s instead of 60, before Patroni 3.1's next loop
        # would start a second, concurrent demotion; standbys notice a silent primary as fast.
        wal_sender_timeout: 2s
        wal_receiver_timeout: 2s
        # A standby retries streaming 4 times a second instead of every 5 s: after a
        # promotion its first attempt fails (the new primary creates the standby's slot at its
        # next loop), and it waits again at the end of the old timeline; at 5 s each, that was
        # 5 to 10 s of commits blocked in strict mode after every failover (docs/ha.md).
        wal_retrieve_retry_interval: 250ms
        shared_buffers: 128MB
        fsync: "on"
        full_page_writes: "on"
  initdb:
    - encoding: UTF8
    - data-checksums
postgresql:
  listen: $addr:$pg_port
  connect_address: $addr:$pg_connect_port
  data_dir: $dir/n$n/data
  bin_dir: $pg_bin
  pgpass: $dir/n$n/pgpass
  remove_data_directory_on_rewind_failure: true
  remove_data_directory_on_diverged_timelines: true
  # A clone (a new node, or one whose data folder was removed) asks the leader for an
  # immediate checkpoint: with the default spread one, it waited 98 s under load.
  basebackup:
    - checkpoint: fast
  authentication:
    superuser:
      username: postgres
      password: "$(cat "$dir/secret")"
    replication:
      username: replicator
      password: "$(cat "$dir/secret")"
  parameters:
    unix_socket_directories: $dir/n$n
  pg_hba:
    - local all all trust
    - host replication replicator $net.0/24 scram-sha-256
    - host all all $net.0/24 scram-sha-256
watchdog:
  mode: off
tags:
  nofailover: false
  noloadbalance: false
  clonefrom: false
YAML
  chown -R postgres:postgres "$dir/n$n"
  chmod 700 "$dir/n$n"
}

# HAProxy sends writes to the one node that holds the leader lock AND is out of recovery:
# Patroni's /primary answers 200 on the lock alone (also while a crashed leader's PostgreSQL
# is restarting read-only), while its body's "role" comes from pg_is_in_recovery(). A node
# marked down has its sessions closed, so no pooled connection stays on a demoted node.
write_haproxy_config() {
  local n
  {
    cat <<CFG
global
    maxconn 2000
    log stderr format iso local0 notice
defaults
    mode tcp
    log global
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    timeout check 1s
listen stats
    mode http
    bind 127.0.0.1:$haproxy_stats_port
    stats enable
    stats uri /
listen primary
    bind 127.0.0.1:$haproxy_port
    option httpchk
    http-check send meth GET uri /primary
    http-check expect status 200
    http-check expect rstring "\"role\": \"(primary|master)\""
    default-server inter 500ms fastinter 250ms downinter 250ms fall ${ONCEPAY_HA_CHECK_FALL:-2} rise 1 on-marked-down shutdown-sessions
CFG
    for n in "${nodes[@]}"; do
      echo "    server n$n $(node_addr "$n"):$pg_connect_port check port $rest_port"
    done
  } >"$dir/haproxy.cfg"
}

# ---------------------------------------------------------------- cluster state

cluster_json() {
  local n out
  for n in "${nodes[@]}"; do
    out="$(in_hub curl -fsS --max-time 1 "http://$(node_addr "$n"):$rest_port/cluster" 2>/dev/null)" || continue
    echo "$out"
    return 0
  done
  return 1
}

status() {
  local json
  json="$(cluster_json)" || { echo "leader= timeline=0 sync= members=unreachable"; return 0; }
  jq -r '
    ([.members[] | select(.role == "leader")] | first) as $l
    | "leader=\($l.name // "") timeline=\($l.timeline // 0) sync=\([.members[] | select(.role == "sync_standby") | .name] | join(","))"
      + " members=\([.members[] | "\(.name):\(.role):\(.state)"] | join(","))"' <<<"$json"
}

field() { status | tr ' ' '\n' | sed -n "s/^$1=//p"; }

db_url() { echo "postgresql://$1:$(cat "$dir/secret")@127.0.0.1:$haproxy_port/$2"; }

writable() {
  [ "$(in_hub timeout 3 psql -X -qtA "$(db_url postgres postgres)" -c 'SELECT NOT pg_is_in_recovery()' 2>/dev/null)" = t ]
}

# wait-healthy [SECS]: a writable leader through HAProxy, two streaming standbys, one synchronous.
wait_healthy() {
  local limit="${1:-120}" start=$SECONDS line
  while [ $((SECONDS - start)) -lt "$limit" ]; do
    line="$(status)"
    if [[ "$line" == *"sync=n"* ]] && [ "$(grep -o ':streaming' <<<"$line" | wc -l)" = 2 ] \
      && [[ "$line" != *"leader= "* ]] && writable; then
      log "healthy after $((SECONDS - start)) s: $line"
      return 0
    fi
    sleep 0.5
  done
  log "not healthy after $limit s: $(status)"
  return 1
}

# wait_new_leader OLD [SECS]: a leader other than OLD, writable through HAProxy.
wait_new_leader() {
  local old="$1" limit="${2:-90}" start=$SECONDS l
  while [ $((SECONDS - start)) -lt "$limit" ]; do
    l="$(field leader)"
    if [ -n "$l" ] && [ "$l" != "$old" ] && writable; then
      log "new leader $l after $((SECONDS - start)) s"
      return 0
    fi
    sleep 0.5
  done
  log "no new leader after $limit s: $(status)"
  return 1
}

node_of() { echo "${1#n}"; }

# ---------------------------------------------------------------- up / down

up() {
  [ "$(id -u)" = 0 ] || die "make ha needs root (network namespaces); PostgreSQL and Patroni run as postgres"
  ensure_packages
  [ -x "$bin" ] || die "$bin is missing: run cargo build --release -p oncepay -p oncepay-ha first"
  id postgres >/dev/null 2>&1 || die "no postgres user (the postgresql package creates it)"
  down_quiet
  # The previous run's logs stay, one generation, for a failure to be read after the next run.
  if [ -d "$dir/logs" ]; then rm -rf "$dir.previous-logs"; mv "$dir/logs" "$dir.previous-logs"; fi
  rm -rf "$dir"
  mkdir -p "$dir/logs" "$dir/pids" "$dir/etcd"
  chmod 755 "$dir"
  head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/secret"
  chmod 644 "$dir/secret" # read by the postgres user's Patroni config; the namespaces are private
  net_up
  if [ -n "$delay_us" ]; then
    [ -x "$delay_bin" ] || die "$delay_bin is missing: cargo build --release -p oncepay-bench"
    for n in "${nodes[@]}"; do
      start "delay-n$n" "$(ns_node "$n")" root "$delay_bin" --listen "$(node_addr "$n"):$pg_connect_port" \
        --to "$(node_addr "$n"):$pg_port" --delay-us "$delay_us"
    done
  fi

  start etcd "$ns_hub" root etcd --name hub --data-dir "$dir/etcd" \
    --listen-client-urls "http://$net.1:$etcd_port,http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://$net.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-cluster "hub=http://127.0.0.1:$etcd_peer_port" \
    --heartbeat-interval 100 --election-timeout 1000
  local i n
  for i in $(seq 1 100); do
    in_hub env ETCDCTL_API=3 etcdctl --endpoints "http://127.0.0.1:$etcd_port" --dial-timeout 1s endpoint health >/dev/null 2>&1 && break
    [ "$i" = 100 ] && die "etcd did not start (logs/etcd.log)"
    sleep 0.2
  done

  for n in "${nodes[@]}"; do
    write_patroni_config "$n"
    start "patroni-n$n" "$(ns_node "$n")" postgres "$venv/bin/patroni" "$dir/n$n/patroni.yml"
    # The first node bootstraps alone: the others clone from it instead of racing for initdb.
    if [ "$n" = 1 ]; then
      for i in $(seq 1 120); do
        [ "$(field leader)" = n1 ] && break
        [ "$i" = 120 ] && die "n1 did not bootstrap in 60 s (logs/patroni-n1.log)"
        sleep 0.5
      done
    fi
  done

  write_haproxy_config
  haproxy -c -q -f "$dir/haproxy.cfg" || die "invalid HAProxy configuration"
  start haproxy "$ns_hub" root haproxy -db -f "$dir/haproxy.cfg"
  wait_healthy 180 || die "the cluster did not become healthy"

  local admin app
  admin="$(db_url postgres postgres)"
  in_hub psql -X -q -v ON_ERROR_STOP=1 "$admin" \
    -c "CREATE ROLE oncepay LOGIN PASSWORD '$(cat "$dir/secret")'" \
    -c "CREATE DATABASE oncepay OWNER oncepay" >/dev/null
  app="$(db_url oncepay oncepay)"
  echo "$app" >"$dir/database_url"
  in_hub env DATABASE_URL="$app" timeout 60 "$bin" migrate >>"$dir/logs/migrate.log" 2>&1 || die "migrate failed"
  in_hub env DATABASE_URL="$app" timeout 30 "$bin" tenant create --name ha --main-balance 1000 >"$dir/tenant.json"
  # One key for the stored webhook secrets, the same on the three instances.
  [ -s "$dir/webhook_key" ] || head -c 32 /dev/urandom | base64 >"$dir/webhook_key"
  webhook_key="$(cat "$dir/webhook_key")"
  for i in 0 1 2; do
    # Webhooks: the driver's receiver listens on 127.0.0.1 in the hub (private targets
    # allowed), and failed deliveries are retried within seconds, not hours.
    start "oncepay-$((i + 1))" "$ns_hub" root env DATABASE_URL="$app" ONCEPAY_BIND="127.0.0.1:${app_ports[$i]}" \
      ONCEPAY_METRICS_BIND="127.0.0.1:$((app_ports[i] + 1000))" \
      ONCEPAY_WEBHOOK_SECRET_KEY="$webhook_key" ONCEPAY_WEBHOOK_ALLOW_PRIVATE=1 \
      ONCEPAY_WEBHOOK_RETRY_SCHEDULE="1,2,5,5,10,10,10,10,10,10,10,10" \
      ONCEPAY_DB_POOL_SIZE="${ONCEPAY_HA_POOL_SIZE:-16}" RUST_LOG="${RUST_LOG:-warn}" "$bin" serve
  done
  for i in 0 1 2; do
    for n in $(seq 1 100); do
      in_hub curl -fsS --max-time 1 "http://127.0.0.1:${app_ports[$i]}/readyz" >/dev/null 2>&1 && break
      [ "$n" = 100 ] && die "oncepay-$((i + 1)) did not become ready (logs/oncepay-$((i + 1)).log)"
      sleep 0.2
    done
  done
  log "up: $(status); HAProxy 127.0.0.1:$haproxy_port, oncepay on ${app_ports[*]} (namespace $ns_hub); files in $dir"
}

down_quiet() {
  local n i
  [ -d "$dir/pids" ] || { net_down; return 0; }
  for i in 1 2 3; do stop "oncepay-$i"; done
  stop haproxy
  for n in "${nodes[@]}"; do stop "patroni-n$n"; stop_postmaster "$n"; done
  stop etcd
  for n in "${nodes[@]}"; do stop "delay-n$n"; done
  net_down
}

down() {
  down_quiet
  # Keep the logs of the last run; the data folders go.
  rm -rf "$dir"/n? "$dir/etcd"
  log "down: everything stopped, namespaces removed (logs in $dir/logs)"
}

# ---------------------------------------------------------------- faults

# wait_field NAME [SECS]: the status field NAME once it is not empty (the cluster's view can
# lack its leader for a moment: a leader whose loop stalled past ttl re-takes its key).
wait_field() {
  local v i
  for i in $(seq 1 $((2 * ${2:-30}))); do
    v="$(field "$1")"
    [ -n "$v" ] && { echo "$v"; return 0; }
    sleep 0.5
  done
  return 0
}

fault() {
  local what="$1" leader n sync pid
  leader="$(wait_field leader)"
  [ -n "$leader" ] || die "no leader to inject $what into after 30 s: $(status)"
  n="$(node_of "$leader")"
  echo "$leader" >"$dir/fault.leader"
  case "$what" in
    kill-postmaster)
      pid="$(postmaster_pid "$n")"
      [ -n "$pid" ] || die "no postmaster.pid for $leader"
      kill -KILL "$pid"
      log "kill -9 of $leader's postmaster (pid $pid)"
      ;;
    switchover)
      sync="$(wait_field sync | cut -d, -f1)"
      [ -n "$sync" ] || die "no synchronous standby to switch over to"
      in_hub timeout 60 "$venv/bin/patronictl" -c "$dir/n1/patroni.yml" switchover --leader "$leader" --candidate "$sync" --force >&2
      log "switchover $leader -> $sync"
      ;;
    partition)
      in_hub ip link set "ohv$n" down
      log "partition: $leader cut off from etcd, the other nodes and HAProxy"
      ;;
    kill-patroni-postgres)
      pid="$(postmaster_pid "$n")"
      kill -KILL "$(cat "$dir/pids/patroni-n$n")" ${pid:+"$pid"}
      log "kill -9 of $leader's Patroni and postmaster (pid ${pid:-none})"
      ;;
    stop-standby)
      sync="$(wait_field sync | cut -d, -f1)"
      [ -n "$sync" ] || die "no synchronous standby to stop"
      echo "$sync" >"$dir/fault.standby"
      stop "patroni-$sync" # Patroni stops its PostgreSQL on SIGTERM
      stop_postmaster "$(node_of "$sync")"
      log "stopped the synchronous standby $sync"
      ;;
    *) die "unknown fault $what" ;;
  esac
}

# The last resort of recover, done as an operator (or a supervisor) would, and recorded: a node
# that Patroni has not brought back as a streaming standby within HA_REJOIN_SECS is stopped
# (Patroni, then its postmaster), its data folder removed, and its Patroni started again, which
# clones it from the leader. Each such rebuild is a line in operator-actions, which oncepay-ha
# prints and counts as a failure: it is Patroni failing to rejoin a node on its own.
rebuild_stuck_nodes() {
  local line n m
  line="$(status)"
  for n in "${nodes[@]}"; do
    m="$(tr ' ,' '\n\n' <<<"$line" | sed 's/^members=//' | grep "^n$n:" || true)"
    # Never the node that holds the leader key, whatever its state: its data folder is the
    # primary's. Only standbys (or nodes with no member key) are rebuilt.
    [[ "$m" == *":leader:"* || "$m" == *":streaming" ]] && continue
    log "operator: n$n is not a streaming standby (${m:-no member key}) after ${HA_REJOIN_SECS:-60} s: rebuilding it"
    echo "$(date -u +%FT%T) rebuilt n$n (${m:-no member key}) during recover $1" >>"$dir/operator-actions"
    cp "$dir/logs/patroni-n$n.log" "$dir/logs/patroni-n$n.before-rebuild.log" 2>/dev/null || true
    stop "patroni-n$n"
    stop_postmaster "$n"
    rm -rf "$dir/n$n/data"
    start "patroni-n$n" "$(ns_node "$n")" postgres "$venv/bin/patroni" "$dir/n$n/patroni.yml"
  done
}

recover() {
  local what="$1" old n
  old="$(cat "$dir/fault.leader" 2>/dev/null || true)"
  case "$what" in
    kill-postmaster | switchover) ;;
    partition)
      n="$(node_of "$old")"
      wait_new_leader "$old" 90 || true
      in_hub ip link set "ohv$n" up
      log "partition healed"
      ;;
    kill-patroni-postgres)
      n="$(node_of "$old")"
      wait_new_leader "$old" 90 || true
      stop_postmaster "$n"
      start "patroni-$old" "$(ns_node "$n")" postgres "$venv/bin/patroni" "$dir/n$n/patroni.yml"
      log "restarted $old's Patroni"
      ;;
    stop-standby)
      old="$(cat "$dir/fault.standby")"
      start "patroni-$old" "$(ns_node "$(node_of "$old")")" postgres "$venv/bin/patroni" "$dir/n$(node_of "$old")/patroni.yml"
      log "started $old again"
      ;;
    *) die "unknown fault $what" ;;
  esac
  wait_healthy "${HA_REJOIN_SECS:-60}" && return 0
  rebuild_stuck_nodes "$what"
  wait_healthy 120
}

# ---------------------------------------------------------------- a commit without its standbys

# pay KEY INSTANCE MAX_SECS: POST /payments of 1 with KEY; prints the HTTP status (000: no answer).
pay() {
  in_hub curl -s -o /dev/null -w '%{http_code}' -m "$3" -X POST "http://127.0.0.1:${app_ports[$2]}/payments" \
    -H "Authorization: Bearer $(jq -r .api_key "$dir/tenant.json")" -H "Idempotency-Key: $1" \
    -H 'Content-Type: application/json' -d '{"amount": 1}' || true
}

# Both standbys stopped: strict synchronous mode blocks the commit, and no answer may tell the
# client it happened, neither the first one (past the statement timeout: it does not apply to
# the wait for the standby), nor a retry after the waiting session was terminated (which makes
# the commit visible on the primary alone: a replay of it must wait for the standbys too).
# Then the standbys come back and the retry replays the one payment.
sync_wait_check() {
  local key="sync-wait-$(date +%s%N)" n s1 s2 s3 s4 count
  local su
  su="$(db_url postgres oncepay)"
  for n in 2 3; do stop "patroni-n$n"; stop_postmaster "$n"; done
  [ "$(field leader)" = n1 ] || die "sync-wait check: n1 is not the leader: $(status)"
  s1="$(pay "$key" 0 20)" # ONCEPAY_STATEMENT_TIMEOUT_MS is 15 s
  s2="$(pay "$key" 1 8)"
  in_hub psql -X -qtA "$su" -c "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE wait_event = 'SyncRep'" >/dev/null
  s3="$(pay "$key" 2 8)"
  for n in 2 3; do start "patroni-n$n" "$(ns_node "$n")" postgres "$venv/bin/patroni" "$dir/n$n/patroni.yml"; done
  wait_healthy 120 || die "sync-wait check: the standbys did not come back"
  s4="$(pay "$key" 0 20)"
  count="$(in_hub psql -X -qtA "$su" -c "SELECT count(*) FROM payments WHERE idempotency_key = '$key'")"
  echo "sync-wait: no standby: first attempt $s1, retry $s2, retry after its session was terminated $s3; standbys back: $s4; payments under the key: $count"
  [[ "$s1" != 2* && "$s2" != 2* && "$s3" != 2* && "$s3" != 4* && "$s4" = 201 && "$count" = 1 ]] \
    || die "sync-wait check failed: an answer before the standbys had the commit, or not one payment"
}

# ---------------------------------------------------------------- run

run() {
  [ -x "$driver" ] || die "$driver is missing: run cargo build --release -p oncepay -p oncepay-ha first"
  # The verdict is the driver's last line: what stopping prints goes to the log folder.
  trap 'status=$?; down 2>>"$dir/logs/down.log"; exit $status' EXIT
  trap 'exit 130' INT TERM
  local started=$SECONDS
  up
  sync_wait_check
  local api_key tenant
  api_key="$(jq -r .api_key "$dir/tenant.json")"
  tenant="$(jq -r .tenant_id "$dir/tenant.json")"
  # The driver runs in the hub namespace, where the instances and HAProxy are.
  # Its output is also kept in the log folder (driver.out, driver.err), beside Patroni's.
  in_hub env DATABASE_URL="$(cat "$dir/database_url")" ONCEPAY_API_KEY="$api_key" ONCEPAY_TENANT_ID="$tenant" \
    ONCEPAY_BIN="$bin" ONCEPAY_HA_SCRIPT="$0" ONCEPAY_HA_DIR="$dir" ONCEPAY_HA_ELAPSED_SECS="$((SECONDS - started))" \
    HA_MAX_UNAVAILABLE_S="${HA_MAX_UNAVAILABLE_S:-}" \
    ONCEPAY_URLS="$(printf 'http://127.0.0.1:%s,' "${app_ports[@]}" | sed 's/,$//')" \
    timeout "${ONCEPAY_HA_TIMEOUT_SECS:-900}" "$driver" > >(tee "$dir/logs/driver.out") 2> >(tee "$dir/logs/driver.err" >&2)
}

case "${1:-}" in
  run) run ;;
  up) up ;;
  down) down ;;
  status) status ;;
  fault) fault "${2:?fault name}" ;;
  recover) recover "${2:?fault name}" ;;
  wait-healthy) wait_healthy "${2:-120}" ;;
  env)
    printf 'ha_dir=%q ha_ns_hub=%q ha_net=%q ha_haproxy_port=%q ha_pg_port=%q ha_pg_connect_port=%q\n' \
      "$dir" "$ns_hub" "$net" "$haproxy_port" "$pg_port" "$pg_connect_port"
    printf 'ha_ns_nodes=(%s) ha_app_ports=(%s)\n' "$(for n in "${nodes[@]}"; do printf '%q ' "$(ns_node "$n")"; done)" "${app_ports[*]}"
    ;;
  *) sed -n '2,12p' "$0" >&2; exit 2 ;;
esac
