#!/usr/bin/env bash
# `make schemathesis`: fuzzes a live oncepay server from its own OpenAPI document
# (GET /openapi.json) with Schemathesis, installed from PyPI into a virtualenv under target/.
# Fails on any server error, undocumented status, wrong content type, missing documented
# header or body that breaks its schema. Needs DATABASE_URL (a database it may write to).
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
cd "$top"

version="4.32.5"
venv="target/schemathesis-venv"
examples="${SCHEMATHESIS_MAX_EXAMPLES:-100}"
# CPython 3.11's AST constructor is not thread-safe (CPython issue 106905: "AST constructor
# recursion depth mismatch" inside Hypothesis when Schemathesis runs several worker threads):
# use a newer interpreter when the machine has one, else a single worker.
newer='import sys; sys.exit(sys.version_info < (3, 12, 2))'
python=python3
workers=1
pyenv_versions="${PYENV_ROOT:-$HOME/.pyenv}/versions"
for candidate in python3 python3.13 python3.12 "$pyenv_versions"/3.1[2-9]*/bin/python3; do
  if "$candidate" -c "$newer" >/dev/null 2>&1; then
    python="$candidate"
    workers=2
    break
  fi
done
if ! "$venv/bin/schemathesis" --version 2>/dev/null | grep -q "$version" \
  || [ "$("$venv/bin/python" --version 2>&1)" != "$("$python" --version 2>&1)" ]; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$version"
fi

cargo build --locked --quiet --bin oncepay
bin="target/debug/oncepay"
RUST_LOG=warn "$bin" migrate

# The tenant's main account can pay most generated amounts, and its policy processes keyless
# requests too (under a derived key), so generated requests reach the deep paths.
tenant="$("$bin" tenant create --name schemathesis --main-balance 1000000000000 --missing-key-policy fingerprint)"
ONCEPAY_API_KEY="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["api_key"])' "$tenant")"
ONCEPAY_ADMIN_TOKEN="$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
export ONCEPAY_API_KEY ONCEPAY_ADMIN_TOKEN

# A fixed port below Linux's ephemeral range (32768-60999), which no client socket can hold.
port="${SCHEMATHESIS_PORT:-18190}"
base="http://127.0.0.1:$port"
log="target/schemathesis-server.log"
# Top-ups are fuzzed against a real processor (localstripe, on port + 2): without one they
# answer 501 processor_not_configured, a 5xx this run counts as a failure.
stripe_dir="$PWD/target/schemathesis-localstripe"
scripts/localstripe.sh start "$((port + 2))" "$stripe_dir" >/dev/null
ONCEPAY_PROCESSOR_URL="http://127.0.0.1:$((port + 2))" ONCEPAY_PROCESSOR_API_KEY=sk_test_oncepay \
  ONCEPAY_BIND="127.0.0.1:$port" ONCEPAY_METRICS_BIND="127.0.0.1:$((port + 1000))" RUST_LOG=warn "$bin" serve 2>"$log" &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true; scripts/localstripe.sh stop "$stripe_dir"' EXIT
for _ in $(seq 100); do
  curl -fsS "$base/readyz" >/dev/null 2>&1 && break
  kill -0 "$server" 2>/dev/null || { cat "$log"; echo "the server did not start" >&2; exit 1; }
  sleep 0.1
done

report="target/schemathesis-report"
rm -rf "$report"
status=0
timeout 1200 "$venv/bin/schemathesis" --config-file tests/schemathesis/schemathesis.toml run "$base/openapi.json" \
  --checks not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance,negative_data_rejection,missing_required_header,ignored_auth \
  --max-examples "$examples" --seed "${SCHEMATHESIS_SEED:-20240601}" --workers "$workers" \
  --request-timeout 10 \
  --report ndjson --report-dir "$report" --no-color || status=$?

# Every request schemathesis sent, counted from its own event log, and how many got a 5xx.
python3 - "$report" <<'PY'
import glob, json, sys
requests = server_errors = 0
for path in glob.glob(f"{sys.argv[1]}/*.ndjson"):
    with open(path) as f:
        for line in f:
            for interaction in json.loads(line).get("ScenarioFinished", {}).get("recorder", {}).get("interactions", {}).values():
                response = interaction.get("response")
                requests += 1
                if response and response["status_code"] >= 500:
                    server_errors += 1
print(f"schemathesis: {requests} requests sent, {server_errors} answered with a 5xx")
PY
exit "$status"
