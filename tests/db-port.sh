#!/usr/bin/env bash
# `make db-port-test`: the local cluster starts while a client socket holds the port that was
# its default until 2026-11 (55130, inside Linux's ephemeral range 32768-60999, where any
# outgoing connection may be given it), and its port now lies below that range.
#
# The cluster is stopped first when it runs (so that `make db-up` really starts it) and is left
# running afterwards.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
cd "$top"
old_port=55130

fail() { echo "db-port-test: FAILED: $*" >&2; exit 1; }

port="$(scripts/db.sh url | sed -n 's|.*@127\.0\.0\.1:\([0-9]*\)/.*|\1|p')"
read -r low high </proc/sys/net/ipv4/ip_local_port_range
[ -n "$port" ] || fail "no port in $(scripts/db.sh url)"
if [ "$port" -ge "$low" ] && [ "$port" -le "$high" ]; then
  fail "the cluster's port $port lies in the ephemeral range $low-$high"
fi

# The holder: a connected client socket bound to 127.0.0.1:$old_port (no SO_REUSEADDR, as an
# ordinary outgoing connection), then proof that a listener cannot bind there now, as
# PostgreSQL could not. When something else holds the port already, that is the same case.
fifo="$(mktemp -u)"
mkfifo "$fifo"
python3 - "$old_port" >"$fifo" <<'PY' &
import errno, socket, sys, time
port = int(sys.argv[1])
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(1)
client = socket.socket()
try:
    client.bind(("127.0.0.1", port))
    client.connect(server.getsockname())
    how = f"a client socket 127.0.0.1:{port} -> {server.getsockname()[1]}"
except OSError as e:
    if e.errno != errno.EADDRINUSE:
        raise
    how = f"another process (port {port} was already in use)"
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    listener.bind(("127.0.0.1", port))
    print(f"free: a listener could still bind {port}", flush=True)
except OSError as e:
    print(f"held by {how}: a listener's bind fails with {errno.errorcode[e.errno]}", flush=True)
time.sleep(600)
PY
holder=$!
trap 'kill "$holder" 2>/dev/null || true; rm -f "$fifo"' EXIT
read -r line <"$fifo"
echo "db-port-test: port $old_port $line"
case "$line" in held*) ;; *) fail "could not hold port $old_port" ;; esac

scripts/db.sh down
scripts/db.sh up || fail "make db-up could not start the cluster while port $old_port was held"
answer="$(psql -X -qtA "$(scripts/db.sh url postgres)" -c 'SHOW port')" || fail "the cluster does not answer"
[ "$answer" = "$port" ] || fail "the cluster listens on $answer, not $port"
echo "db-port-test: the local cluster started on 127.0.0.1:$port (outside $low-$high) while $old_port was held"
echo "db-port-test: 1 passed, 0 failed"
