#!/usr/bin/env bash
# PgBouncer in transaction mode in front of the project-local cluster (scripts/db.sh), for
# `make test-pgbouncer` and for measuring oncepay through a pooler (docs/scaling.md).
#
#   scripts/pgbouncer.sh up      install it if missing (Debian `pgbouncer`), write its config, start it
#   scripts/pgbouncer.sh down    stop it (by the PID in its pidfile)
#   scripts/pgbouncer.sh url DB  print the URL of database DB through it
#   scripts/pgbouncer.sh bin     print the path of its binary, installing it if missing
#                                (make bench-ha runs its own PgBouncer with it)
#
# It listens on 127.0.0.1:$ONCEPAY_PGBOUNCER_PORT only (default 25139) and forwards every
# database to 127.0.0.1:$ONCEPAY_PG_PORT (default 25130), trusting the user `oncepay` like
# the cluster does. PgBouncer refuses to run as root, so as root it runs as the `postgres`
# user with its files under /var/tmp.
set -euo pipefail

port="${ONCEPAY_PGBOUNCER_PORT:-25139}"
pg_port="${ONCEPAY_PG_PORT:-25130}"
top="$(cd "$(dirname "$0")/.." && pwd)"
if [ "$(id -u)" = 0 ]; then
  dir="/var/tmp/oncepay-pgbouncer-$(printf '%s:%s' "$top" "$port" | sha256sum | cut -c1-12)"
else
  dir="$top/.pgbouncer-$port"
fi
pidfile="$dir/pgbouncer.pid"

as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

binary() {
  if command -v pgbouncer >/dev/null 2>&1; then command -v pgbouncer; return; fi
  [ -x /usr/sbin/pgbouncer ] && { echo /usr/sbin/pgbouncer; return; }
  return 1
}

install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "pgbouncer.sh: PgBouncer not found; installing it with apt-get" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >&2
  else
    echo "pgbouncer.sh: PgBouncer is not installed. Install it, e.g.: sudo apt-get install -y pgbouncer" >&2
    exit 1
  fi
}

running() {
  [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

up() {
  local bin
  bin="$(binary)" || { install; bin="$(binary)"; }
  running && return 0
  mkdir -p "$dir"
  # The settings docs/scaling.md recommends, sized for the test suite's many small pools.
  cat >"$dir/pgbouncer.ini" <<CONF
[databases]
* = host=127.0.0.1 port=$pg_port

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $dir/userlist.txt
pool_mode = transaction
max_client_conn = 2000
default_pool_size = 100
max_db_connections = 200
server_lifetime = 3600
server_idle_timeout = 60
query_wait_timeout = 30
server_login_retry = 1
log_connections = 0
admin_users = oncepay
log_disconnections = 0
logfile = $dir/pgbouncer.log
pidfile = $pidfile
CONF
  echo '"oncepay" ""' >"$dir/userlist.txt"
  [ "$(id -u)" = 0 ] && chown -R postgres:postgres "$dir"
  rm -f "$pidfile"
  as_pg "$bin" -d "$dir/pgbouncer.ini" || { tail -n 20 "$dir/pgbouncer.log" >&2; exit 1; }
  local i
  for i in $(seq 1 50); do
    if running && (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "pgbouncer.sh: PgBouncer did not start on port $port" >&2
  tail -n 20 "$dir/pgbouncer.log" >&2
  exit 1
}

down() {
  running || return 0
  local pid i
  pid="$(cat "$pidfile")"
  kill "$pid"
  for i in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || { echo "pgbouncer.sh: stopped PgBouncer on port $port" >&2; return 0; }
    sleep 0.1
  done
  echo "pgbouncer.sh: PgBouncer (pid $pid) still running after 10 s; killing it" >&2
  kill -9 "$pid" 2>/dev/null || true
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  url) echo "postgres://oncepay@127.0.0.1:$port/${2:-oncepay}" ;;
  dir) echo "$dir" ;;
  bin) binary || { install; binary; } ;;
  *) echo "usage: $0 up|down|url [DB]|dir|bin" >&2; exit 2 ;;
esac
