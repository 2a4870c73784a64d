#!/usr/bin/env bash
# `make alerts-test`: checks the Prometheus rules in ops/prometheus/ and runs their unit
# tests with promtool. promtool comes from Debian's `prometheus` package, installed here
# when missing (as root, non-interactively: CI runs on a fresh machine).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "alerts-test: promtool not found; installing Debian's prometheus package" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >&2
  else
    echo "alerts-test: promtool not found. Install it, e.g.: sudo apt-get install -y prometheus" >&2
    exit 1
  fi
fi

promtool check rules ops/prometheus/rules.yml
promtool test rules ops/prometheus/tests/*.yml

# The dashboard's queries must parse too: promtool checks them as recording rules, with
# Grafana's $job variable replaced by a regex. (Which series they read, and that the
# server exports them, is tests/api/dashboards.rs.)
dashboard_rules="$(mktemp --suffix=.yml)"
trap 'rm -f "$dashboard_rules"' EXIT
python3 - ops/grafana/oncepay.json >"$dashboard_rules" <<'PY'
import json, sys

def exprs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from exprs(item)

queries = list(exprs(json.load(open(sys.argv[1]))))
assert queries, "no queries in the dashboard"
print("groups:\n  - name: dashboard\n    rules:")
for n, query in enumerate(queries):
    print(f"      - record: dashboard:query_{n}\n        expr: {json.dumps(query.replace('$job', '.+'))}")
PY
echo "Checking ops/grafana/oncepay.json queries"
promtool check rules "$dashboard_rules" | sed 's/^/  /'
