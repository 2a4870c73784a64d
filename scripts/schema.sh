#!/usr/bin/env bash
# The schema as the migrations leave it, in one place to read (`make schema`, checked by
# `make schema-check` in `make check`):
#
#   scripts/schema.sh DIR    migrates a scratch database on the local cluster with psql (as
#                            `make sqlx-prepare` does) and writes
#                            DIR/tables.sql: pg_dump --schema-only without the functions, the
#                              version lines, the session settings or pg_dump's random
#                              \restrict key: types, domains, tables, indexes, triggers,
#                              views, comments, in pg_dump's stable order;
#                            DIR/functions/<name>.sql: each oncepay_* function as
#                              pg_get_functiondef writes it, the overloads of one name in one
#                              file, ordered by their arguments.
#
# Migrations are history (never edited); schema/ is the present: read a function there, not
# in the migration that last replaced it. The scratch database is dropped afterwards.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
cd "$top"
out="${1:?usage: scripts/schema.sh DIR}"
db="${SCHEMA_SCRATCH_DB:-oncepay_schema_dump}"
admin="$(scripts/db.sh url postgres)"
url="$(scripts/db.sh url "$db")"
bindir="$(scripts/db.sh bindir)"

psql -X -q "$admin" -c 'SET client_min_messages = warning' -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" \
  -c "CREATE DATABASE $db"
trap 'psql -X -q "$admin" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true' EXIT
for f in $(ls migrations/V*__*.sql | sort -t V -k2 -n); do
  psql -X -q -v ON_ERROR_STOP=1 "$url" -f "$f" >/dev/null
done

rm -rf "$out"
mkdir -p "$out/functions"
"$bindir/pg_dump" --schema-only --no-owner --no-privileges "$url" | python3 -c '
import re, sys
text = sys.stdin.read()
# pg_dump writes each object after a header "--\n-- Name: ...; Type: ...; ...\n--\n".
parts = re.split(r"(?m)^--\n-- (?=Name: )", text)
kept = []
for part in parts[1:]:
    header = part.split("\n", 1)[0]
    if "; Type: FUNCTION;" in header:
        continue
    kept.append("--\n-- " + part)
body = "".join(kept)
# pg_dump 15.14 and later: a random key per dump, and its release at the end.
body = re.sub(r"(?m)^\\(un)?restrict .*\n", "", body)
body = re.sub(r"--\n-- PostgreSQL database dump complete\n--\n", "", body)
print("-- The schema the migrations leave (scripts/schema.sh; `make schema` rewrites it, `make check`")
print("-- fails while it is stale). Functions: schema/functions/.")
print()
print(body.rstrip() + "\n", end="")
' >"$out/tables.sql"

psql -X -q -tA -v ON_ERROR_STOP=1 "$url" -F ' ' -c "
  SELECT p.proname, p.oid
    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
   WHERE n.nspname = 'public' AND p.proname LIKE 'oncepay\\_%'
   ORDER BY p.proname, pg_get_function_identity_arguments(p.oid) COLLATE \"C\"" |
  while read -r name oid; do
    {
      psql -X -q -tA -v ON_ERROR_STOP=1 "$url" -c "SELECT pg_get_functiondef($oid)"
      echo
    } >>"$out/functions/$name.sql"
  done
echo "schema: $(grep -c '^CREATE' "$out/tables.sql") objects in $out/tables.sql, $(ls "$out/functions" | wc -l) functions in $out/functions/" >&2
