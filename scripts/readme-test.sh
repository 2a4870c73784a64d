#!/usr/bin/env bash
# `make readme-test`: the examples of README.md and docs/lab.md against `make run`'s server.
# Starts `make run` in the background (its own process group, its output in
# target/readme-test-server.log), waits until it is ready, runs tests/readme/run.py, and stops
# the server again, also on failure.
# Refuses to start while something answers on ONCEPAY_BIND (127.0.0.1:8130): stop that server,
# or run tests/readme/run.py against it yourself.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
cd "$top"
bind="${ONCEPAY_BIND:-127.0.0.1:8130}"
log="target/readme-test-server.log"
mkdir -p target

if curl -s -o /dev/null -m 1 "http://$bind/healthz"; then
  echo "readme-test: a server already answers on $bind: stop it, or set ONCEPAY_BIND to a free address" >&2
  exit 1
fi
echo "readme-test: make run (server log in $log)"
# Job control: the server's make gets a process group of its own, stopped as a whole below.
set -m
make --no-print-directory run >"$log" 2>&1 &
server=$!
set +m
trap 'kill -- -"$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
# The first make run compiles the release binary (about 9 minutes on 2 cores).
for _ in $(seq 1800); do
  curl -fsS -o /dev/null -m 1 "http://$bind/readyz" 2>/dev/null && break
  kill -0 "$server" 2>/dev/null || { tail -n 30 "$log" >&2; echo "readme-test: make run stopped" >&2; exit 1; }
  sleep 0.5
done
curl -fsS -o /dev/null -m 1 "http://$bind/readyz" || { tail -n 30 "$log" >&2; echo "readme-test: the server is not ready" >&2; exit 1; }
tests/readme/run.py
