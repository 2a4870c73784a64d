#!/usr/bin/env bash
# `make sql-callgrind` (about 4 minutes): PostgreSQL's own instructions per new payment and per
# replay, for the SQL of this tree against the SQL of another revision (SQL_CALLGRIND_BASE,
# default 623b367: the V2 functions before the operation table). Counted by callgrind in one
# single-user backend, so the figures repeat to a fraction of a percent on a noisy machine and
# see nothing of the client, the network or other sessions: what the functions themselves cost.
#
# Each side gets a database on a throwaway cluster (fsync off, port SQL_CALLGRIND_PORT) with its
# migrations, one tenant, 10,000 accounts and 20,000 payments made by its own oncepay_pay, then
# ANALYZE (the steady state: plans as in production, not those of empty tables). Then, per side
# and kind, `postgres --single` under callgrind runs N1 and N2 prepared calls (new keys, or
# replays of the seeded keys): instructions per call = (Ir(N2) - Ir(N1)) / (N2 - N1), which
# cancels start-up and the first plans. Where a side has webhooks (V9 on), a second tenant with
# one subscribed endpoint makes the third kind, `hooked`: new payments that write an event, the
# outbox's own cost against `new` (docs/webhooks.md; make bench measures it in payments/s). Where
# a side has `oncepay_pay_batch` (V20), `batch` and `hooked-batch` are the same payments eight
# to a call of it, prepared as the server's batch statement (src/ledger/effects.rs), counted per
# payment: what a payment costs under load, where the batcher groups them. Where a side has
# `oncepay_pay_many` (V13), `pooled-replay` is a replay as it reaches PostgreSQL through a
# transaction-mode pooler: one item rendered into `SELECT oncepay_pay_many('<json>')`, a
# simple-protocol statement of its own (src/ledger/effects.rs, `run_batch_rendered`). The
# cluster is removed at the end, also on failure; SQL_CALLGRIND_OUT=dir keeps the callgrind files.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
cd "$top"

base="${SQL_CALLGRIND_BASE:-623b367}"
port="${SQL_CALLGRIND_PORT:-25198}"
n1="${SQL_CALLGRIND_N1:-100}"
n2="${SQL_CALLGRIND_N2:-600}"
work="/var/tmp/oncepay-sqlcg-$(printf '%s' "$top" | sha256sum | cut -c1-12)"
bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
[ -x "$bin/postgres" ] || { echo "sql-callgrind: PostgreSQL not found (make db-up installs it)" >&2; exit 1; }
command -v valgrind >/dev/null || { echo "sql-callgrind: valgrind not installed (make callgrind installs it)" >&2; exit 1; }
say() { echo "sql-callgrind: $(date +%T) $*" >&2; }
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

# A clean stop before measuring: after an immediate one, the first single-user run would
# replay the WAL of the whole load.
stop() { as_pg "$bin/pg_ctl" -D "$work/data" -m fast -w stop >/dev/null 2>&1 || true; }
cleanup() { stop; rm -rf "$work"; }
trap cleanup EXIT
cleanup
mkdir -p "$work"
[ "$(id -u)" = 0 ] && chown postgres "$work"
as_pg "$bin/initdb" -D "$work/data" -U oncepay --auth=trust >/dev/null
printf "port = %s\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '%s'\nfsync = off\n" \
  "$port" "$work/data" | as_pg tee -a "$work/data/postgresql.conf" >/dev/null
as_pg "$bin/pg_ctl" -D "$work/data" -l "$work/log" -w start >/dev/null
psql() { "$bin/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" -U oncepay "$@"; }

tenant="'00000000-0000-0000-0000-000000000001'"
hooked="'00000000-0000-0000-0000-000000000002'"
has_webhooks() { [ "$(psql -d "$1" -tAc "SELECT to_regclass('webhook_endpoints') IS NOT NULL")" = t ]; }
has_batch() { [ "$(psql -d "$1" -tAc "SELECT to_regproc('oncepay_pay_batch') IS NOT NULL")" = t ]; }
has_many() { [ "$(psql -d "$1" -tAc "SELECT to_regproc('oncepay_pay_many') IS NOT NULL")" = t ]; }
# The call of each generation of oncepay_pay, as a format string over (key, fingerprint, account).
call_of() { # db -> the call template
  if [ "$(psql -d "$1" -tAc "SELECT pronargs FROM pg_proc WHERE proname = 'oncepay_pay'")" = 7 ]; then
    echo "oncepay_pay($tenant, %s, false, %s, 86400, %s, 1)"
  else
    echo "oncepay_pay($tenant, ROW(%s, false, %s, 'pay', 'POST', '/payments', 86400, 5000, 201, '{\"insufficient_funds\": 402, \"account_not_found\": 404}')::oncepay_claim_args, %s, 1)"
  fi
}

load() { # db, then the migration files of that side
  local db="$1"
  shift
  psql -d postgres -c "CREATE DATABASE $db"
  for f in "$@"; do psql -d "$db" -f "$f" >/dev/null; done
  psql -d "$db" -c "INSERT INTO tenants (tenant_id, name, api_key_hash) VALUES ($tenant, 'bench', sha256('x'))" \
    -c "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance)
        SELECT $tenant, i::text, 1000000000000, 1000000000000 FROM generate_series(0, 9999) i"
  local call
  # shellcheck disable=SC2059
  call="$(printf "$(call_of "$db")" "'seed-' || i" "sha256(i::text::bytea)" "(i % 10000)::text")"
  psql -d "$db" -c "SELECT count(*) FROM (SELECT $call FROM generate_series(1, 500) i) s" -c ANALYZE \
    -c "SELECT count(*) FROM (SELECT $call FROM generate_series(501, 20000) i) s" -c "VACUUM ANALYZE" >/dev/null
  if has_webhooks "$db"; then
    # The hooked tenant, its endpoint (never delivered to: no deliverer runs) and 2,000 events.
    psql -d "$db" -c "INSERT INTO tenants (tenant_id, name, api_key_hash) VALUES ($hooked, 'hooked', sha256('y'))" \
      -c "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance)
          SELECT $hooked, i::text, 1000000000000, 1000000000000 FROM generate_series(0, 9999) i" \
      -c "INSERT INTO webhook_endpoints (tenant_id, endpoint_id, url, secret_encrypted, created_at)
          VALUES ($hooked, gen_random_uuid(), 'https://example.com/hooks', '\\x00', now())" \
      -c "SELECT count(*) FROM (SELECT ${call//$tenant/$hooked} FROM generate_series(1, 2000) i) s" \
      -c "VACUUM ANALYZE" >/dev/null
  fi
}

say "loading the migrations of $base and of this tree"
mkdir -p "$work/base"
for f in $(git ls-tree --name-only "$base" migrations/ | sort -V); do git show "$base:$f" >"$work/base/$(basename "$f")"; done
# shellcheck disable=SC2046
load sqlcg_base $(ls "$work"/base/V*.sql | sort -V)
# shellcheck disable=SC2046
load sqlcg_tree $(ls migrations/V*.sql | sort -V)
declare -A calls=([sqlcg_base]="$(call_of sqlcg_base)" [sqlcg_tree]="$(call_of sqlcg_tree)")
declare -A webhooks=()
declare -A batches=()
declare -A manys=()
for db in sqlcg_base sqlcg_tree; do
  if has_webhooks "$db"; then webhooks[$db]=1; fi
  if has_batch "$db"; then batches[$db]=1; fi
  if has_many "$db"; then manys[$db]=1; fi
done
stop

# Payments eight to a batch call.
batch_size=8
script() { # db kind n -> a single-user input of n payments
  local call="${calls[$1]}" who="$tenant"
  case "$2" in hooked | hooked-batch) call="${call//$tenant/$hooked}" who="$hooked" ;; esac
  python3 - "$1" "$2" "$3" "$call" "$who" "$batch_size" <<'EOF'
import hashlib, json, sys
db, kind, n, call, who, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])
if kind == "pooled-replay":
    # As run_batch_rendered sends it: the items as JSON, a literal in a statement of its own.
    for i in range(n):
        j = 1 + i % 20000
        claim = {"key": f"seed-{j}", "derived": False,
                 "fingerprint": "\\x" + hashlib.sha256(str(j).encode()).hexdigest(),
                 "operation": "pay", "method": "POST", "path": "/payments", "window_secs": 86400,
                 "inflight_wait_ms": 5000, "success_status": 201,
                 "decline_statuses": {"insufficient_funds": 402, "account_not_found": 404}}
        items = json.dumps([{"tenant": who.strip("'"), "claim": claim, "account": str(j % 10000), "amount": 1}])
        print("SELECT oncepay_pay_many('" + items.replace("'", "''") + "'::text::jsonb);")
    sys.exit()
if kind.endswith("batch"):
    print("PREPARE p(uuid[], oncepay_claim_args[], text[], bigint[]) AS SELECT item, outcome, decline, expires_at,"
          " resource FROM oncepay_pay_batch($1, $2, $3, $4) ORDER BY item;")
    claim = ("ROW('cg-%s-%d-%d', false, '\\x" + "ab" * 32 + "', 'pay', 'POST', '/payments', 86400, 5000, 201,"
             " '{\"insufficient_funds\": 402, \"account_not_found\": 404}')::oncepay_claim_args")
    for b in range(n // size):
        items = range(b * size, (b + 1) * size)
        print("EXECUTE p(ARRAY[" + ", ".join([who] * size) + "]::uuid[], ARRAY["
              + ", ".join(claim % (kind, n, i) for i in items) + "], ARRAY["
              + ", ".join(f"'{i % 10000}'" for i in items) + "], ARRAY[" + ", ".join(["1"] * size) + "]::bigint[]);")
    sys.exit()
# Prepared, as the service's statements are: the outer statement is planned once.
print("PREPARE p(text, bytea, text) AS SELECT * FROM " + (call % ("$1", "$2", "$3")) + ";")
for i in range(n):
    if kind in ("new", "hooked"):
        key, fp, acct = f"'cg-{kind}-{n}-{i}'", "'\\x" + "ab" * 32 + "'", f"'{i % 10000}'"
    else:  # a replay of seed-j, with the fingerprint it was made with
        j = 1 + i % 20000
        key, fp, acct = f"'seed-{j}'", "'\\x" + hashlib.sha256(str(j).encode()).hexdigest() + "'", f"'{j % 10000}'"
    print(f"EXECUTE p({key}, {fp}, {acct});")
EOF
}

# How a side is named in the table.
label() { if [ "$1" = sqlcg_base ]; then echo "$base"; else echo "this tree ($(git rev-parse --short HEAD)+)"; fi; }

printf '%-28s %-12s %14s\n' "migrations" "call" "instructions"
declare -A per_call=()
for kind in new replay hooked batch hooked-batch pooled-replay; do
  for db in sqlcg_base sqlcg_tree; do
    if [ "$kind" = hooked ] && [ -z "${webhooks[$db]:-}" ]; then continue; fi
    if [ "$kind" = pooled-replay ] && [ -z "${manys[$db]:-}" ]; then continue; fi
    case "$kind" in *batch) [ -n "${batches[$db]:-}" ] || continue ;; esac
    ir=()
    for n in "$n1" "$n2"; do
      script "$db" "$kind" "$n" >"$work/in.sql"
      as_pg valgrind --tool=callgrind --callgrind-out-file="$work/cg.$db.$kind.$n" \
        "$bin/postgres" --single -D "$work/data" -c fsync=off "$db" <"$work/in.sql" >"$work/out" 2>"$work/err"
      grep -q 'ERROR' "$work/out" "$work/err" && { echo "sql-callgrind: $db $kind failed:" >&2; grep -m3 ERROR "$work/out" "$work/err" >&2; exit 1; }
      ir+=("$(awk '/^summary:/ {print $2}' "$work/cg.$db.$kind.$n")")
    done
    # Payments made between the two runs (a batch kind makes whole batches of n).
    case "$kind" in
      *batch) made=$((n2 / batch_size * batch_size - n1 / batch_size * batch_size)) ;;
      *) made=$((n2 - n1)) ;;
    esac
    per_call[$db.$kind]=$(((ir[1] - ir[0]) / made))
    printf '%-28s %-12s %14d\n' "$(label "$db")" "$kind" "${per_call[$db.$kind]}"
  done
done
for db in sqlcg_base sqlcg_tree; do
  [ -n "${per_call[$db.hooked]:-}" ] || continue
  awk -v l="$(label "$db")" -v n="${per_call[$db.new]}" -v h="${per_call[$db.hooked]}" \
    'BEGIN { printf "%-28s new / hooked: %.3f (the outbox costs a payment %d instructions)\n", l, n / h, h - n }'
done
for db in sqlcg_base sqlcg_tree; do
  [ -n "${per_call[$db.hooked-batch]:-}" ] || continue
  awk -v l="$(label "$db")" -v n="${per_call[$db.batch]}" -v h="${per_call[$db.hooked-batch]}" -v s="$batch_size" \
    'BEGIN { printf "%-28s batch / hooked-batch: %.3f (in batches of %d, the outbox costs a payment %d instructions)\n", l, n / h, s, h - n }'
done
# SQL_CALLGRIND_OUT=dir keeps the callgrind files (cg.<db>.<kind>.<calls>) for callgrind_annotate.
if [ -n "${SQL_CALLGRIND_OUT:-}" ]; then
  mkdir -p "$SQL_CALLGRIND_OUT"
  cp "$work"/cg.* "$SQL_CALLGRIND_OUT"/
fi
