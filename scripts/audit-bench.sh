#!/usr/bin/env bash
# Times `oncepay audit` on a generated ledger (default one million payments) in a scratch
# database that it drops first:
#
#   scripts/audit-bench.sh BIN ADMIN_URL DB [PAYMENTS]
#
# ADMIN_URL names any database of the cluster (to drop and create DB). Prints the audit's
# report and its wall-clock time, three runs (the first one reads a cold cache).
set -euo pipefail
bin="$1" admin_url="$2" db="$3" payments="${4:-1000000}"
top="$(cd "$(dirname "$0")/.." && pwd)"
db_url="${admin_url%/*}/$db"

psql -X -q "$admin_url" -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" -c "CREATE DATABASE \"$db\""
DATABASE_URL="$db_url" "$bin" migrate 2>/dev/null
echo "generating $payments payments in $db ..." >&2
start=$(date +%s.%N)
psql -X -q "$db_url" -v payments="$payments" -f "$top/scripts/audit-bench.sql"
echo "generated in $(echo "$(date +%s.%N) - $start" | bc) s" >&2
for run in 1 2 3; do
  start=$(date +%s.%N)
  DATABASE_URL="$db_url" "$bin" audit --samples 3 2>/dev/null
  echo "run $run: oncepay audit took $(echo "$(date +%s.%N) - $start" | bc) s (wall clock, process start to exit)"
done
