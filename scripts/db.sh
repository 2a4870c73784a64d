#!/usr/bin/env bash
# A project-local PostgreSQL cluster for `make run`, `make test` and `make bench`.
#
#   scripts/db.sh up      start it (initdb on first use), create the databases, print nothing else
#   scripts/db.sh down    stop it (mode ONCEPAY_PG_STOP_MODE: fast, or immediate for a crash)
#   scripts/db.sh url DB  print the URL of database DB on it
#   scripts/db.sh ca      print the path of the CA certificate its TLS certificate is signed by
#
# It listens on 127.0.0.1:$ONCEPAY_PG_PORT only (default 25130) with its socket in the data folder.
# Every port the Makefile's targets listen on lies below Linux's ephemeral range (32768-60999):
# there, any client socket (one in TIME-WAIT for a minute after heavy traffic) could hold it and
# PostgreSQL would fail to bind (tests/db-port.sh checks this).
# PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user and the
# data folder lives under /var/tmp (CI clones may sit under /root, which that user cannot reach).
set -euo pipefail

port="${ONCEPAY_PG_PORT:-25130}"
top="$(cd "$(dirname "$0")/.." && pwd)"
if [ "$(id -u)" = 0 ]; then
  data="${ONCEPAY_PGDATA:-/var/tmp/oncepay-pg-$(printf '%s' "$top" | sha256sum | cut -c1-12)}"
else
  data="${ONCEPAY_PGDATA:-$top/.pgdata}"
fi

pg_bindir() {
  local d
  if command -v pg_config >/dev/null 2>&1; then
    d="$(pg_config --bindir)"
    [ -x "$d/postgres" ] && { echo "$d"; return; }
  fi
  d="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
  [ -n "$d" ] && [ -x "$d/postgres" ] && { echo "$d"; return; }
  return 1
}

as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

install_postgres() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "db.sh: PostgreSQL not found; installing it with apt-get" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql postgresql-contrib >&2
  else
    echo "db.sh: PostgreSQL is not installed. Install it, e.g.: sudo apt-get install -y postgresql postgresql-contrib" >&2
    exit 1
  fi
}

psql_local() {
  "$bin/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" -U oncepay "$@"
}

create_db() {
  local db="$1"
  if ! psql_local -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'" | grep -q 1; then
    psql_local -d postgres -c "CREATE DATABASE \"$db\"" >/dev/null
  fi
}

up() {
  bin="$(pg_bindir)" || { install_postgres; bin="$(pg_bindir)"; }
  if [ ! -s "$data/PG_VERSION" ]; then
    mkdir -p "$data"
    [ "$(id -u)" = 0 ] && chown postgres:postgres "$data"
    chmod 700 "$data"
    as_pg "$bin/initdb" -D "$data" -U oncepay --auth=trust --encoding=UTF8 --no-instructions >"$data.initdb.log" 2>&1 \
      || { cat "$data.initdb.log" >&2; exit 1; }
    cat >>"$data/postgresql.conf" <<CONF
# oncepay local cluster
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$data'
max_connections = 300
shared_buffers = 512MB
wal_buffers = 16MB
max_wal_size = 4GB
checkpoint_timeout = 15min
log_min_messages = warning
CONF
  fi
  if ! { [ -s "$data/server.crt" ] && grep -q '^ssl = on' "$data/postgresql.conf"; }; then
    tls_setup
    # A running cluster made before takes `ssl` on a reload.
    if as_pg "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then as_pg "$bin/pg_ctl" -D "$data" reload >/dev/null; fi
  fi
  # The port is given at start, not only in postgresql.conf: a cluster made under another
  # ONCEPAY_PG_PORT then follows the current one.
  if ! as_pg "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    as_pg "$bin/pg_ctl" -D "$data" -l "$data/server.log" -o "-p $port" -w -t 60 start >/dev/null \
      || { tail -n 20 "$data/server.log" >&2; exit 1; }
  elif [ "$(sed -n 4p "$data/postmaster.pid")" != "$port" ]; then
    echo "db.sh: the cluster in $data runs on port $(sed -n 4p "$data/postmaster.pid"), not $port: make db-down first" >&2
    exit 1
  fi
  local db
  for db in oncepay oncepay_test; do create_db "$db"; done
}

# TLS: a private CA and a server certificate for 127.0.0.1 (an IP SAN only, so that a client
# reaching the cluster as `localhost` with sslmode=verify-full is refused: the tests rely on
# it), made once per cluster with openssl. `ssl = on` still accepts plain connections; the
# TLS tests (tests/api/pg_tls.rs) trust the CA printed by `db.sh ca`.
tls_setup() {
  [ -s "$data/server.crt" ] && grep -q '^ssl = on' "$data/postgresql.conf" && return 0
  command -v openssl >/dev/null 2>&1 || {
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || { echo "db.sh: openssl is missing" >&2; exit 1; }
    apt-get install -y -qq openssl >&2
  }
  local tmp
  tmp="$(mktemp -d)"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=oncepay local CA" \
    -keyout "$tmp/ca.key" -out "$tmp/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout "$tmp/server.key" -out "$tmp/server.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' >"$tmp/ext"
  openssl x509 -req -in "$tmp/server.csr" -CA "$tmp/ca.crt" -CAkey "$tmp/ca.key" -CAcreateserial -days 3650 \
    -extfile "$tmp/ext" -out "$tmp/server.crt" 2>/dev/null
  cp "$tmp/server.crt" "$data/server.crt"
  cp "$tmp/server.key" "$data/server.key"
  cp "$tmp/ca.crt" "$data/oncepay-ca.crt"
  chmod 600 "$data/server.key"
  chmod 644 "$data/server.crt" "$data/oncepay-ca.crt"
  [ "$(id -u)" = 0 ] && chown postgres:postgres "$data/server.crt" "$data/server.key" "$data/oncepay-ca.crt"
  rm -rf "$tmp"
  grep -q '^ssl = on' "$data/postgresql.conf" || echo "ssl = on" >>"$data/postgresql.conf"
}

down() {
  bin="$(pg_bindir)" || exit 0
  if [ -s "$data/PG_VERSION" ] && as_pg "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    as_pg "$bin/pg_ctl" -D "$data" -m "${ONCEPAY_PG_STOP_MODE:-fast}" -w stop >/dev/null
    echo "db.sh: stopped the local cluster in $data" >&2
  fi
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  url) echo "postgres://oncepay@127.0.0.1:$port/${2:-oncepay}" ;;
  bindir) pg_bindir ;;
  datadir) echo "$data" ;;
  ca) echo "$data/oncepay-ca.crt" ;;
  *) echo "usage: $0 up|down|url [DB]|bindir|datadir|ca" >&2; exit 2 ;;
esac
