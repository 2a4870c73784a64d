#!/usr/bin/env bash
# `make run`, after `make migrate`: creates the demo tenant once (main balance 10000),
# prints its API key and a curl line, then serves on ONCEPAY_BIND (127.0.0.1:8130).
# Running it again reuses the tenant, its balance and the admin token: nothing is reset.
set -euo pipefail
bin="$1"
top="$(cd "$(dirname "$0")/.." && pwd)"
demo="$top/.oncepay-demo"
mkdir -p "$demo"
chmod 700 "$demo"

if [ -z "${ONCEPAY_ADMIN_TOKEN:-}" ]; then
  [ -s "$demo/admin_token" ] || head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$demo/admin_token"
  ONCEPAY_ADMIN_TOKEN="$(cat "$demo/admin_token")"
fi
export ONCEPAY_ADMIN_TOKEN
# The key of the stored webhook secrets (docs/security.md), kept beside the admin token.
if [ -z "${ONCEPAY_WEBHOOK_SECRET_KEY:-}" ]; then
  [ -s "$demo/webhook_secret_key" ] || head -c 32 /dev/urandom | base64 >"$demo/webhook_secret_key"
  ONCEPAY_WEBHOOK_SECRET_KEY="$(cat "$demo/webhook_secret_key")"
fi
export ONCEPAY_WEBHOOK_SECRET_KEY
# The demo serves on this machine, and the lab's recovery walkthrough (docs/lab.md) registers a receiver
# on it (127.0.0.1), which a real deployment refuses (docs/webhooks.md).
export ONCEPAY_WEBHOOK_ALLOW_PRIVATE="${ONCEPAY_WEBHOOK_ALLOW_PRIVATE:-1}"

# One demo tenant per database: its file is named after DATABASE_URL, so that pointing
# `make run` at another database creates a tenant there and never overwrites the key made for
# this one. A file whose tenant the database no longer has (a recreated database) is kept
# aside under a dated name, never overwritten.
db_id="$(printf '%s' "$DATABASE_URL" | sha256sum | cut -c1-12)"
tenant_file="$demo/tenant-$db_id.json"
# A database that cannot be asked stops the start (set -e), rather than counting as "not here".
tenant_in_db() {
  local found
  found="$(psql -X -qtA -v ON_ERROR_STOP=1 "$DATABASE_URL" -c "SELECT count(*) FROM tenants WHERE tenant_id::text = '$1'")" || exit 1
  [ "$found" = 1 ]
}
field() { sed -n "s/.*\"$1\":\"\([^\"]*\)\".*/\1/p" "$2"; }
# The single tenant.json of earlier versions becomes this database's file if its tenant is here.
if [ ! -s "$tenant_file" ] && [ -s "$demo/tenant.json" ] && tenant_in_db "$(field tenant_id "$demo/tenant.json")"; then
  mv "$demo/tenant.json" "$tenant_file"
fi
tenant_id=""
if [ -s "$tenant_file" ]; then
  tenant_id="$(field tenant_id "$tenant_file")"
  if ! tenant_in_db "$tenant_id"; then
    old="${tenant_file%.json}.$(date -u +%Y%m%dT%H%M%SZ).old.json"
    mv "$tenant_file" "$old"
    echo "the demo tenant $tenant_id is not in this database any more: its file is kept as ${old#"$top/"}"
    tenant_id=""
  fi
fi
if [ -z "$tenant_id" ]; then
  (umask 077; "$bin" tenant create --name demo --main-balance 10000 >"$tenant_file")
  tenant_id="$(field tenant_id "$tenant_file")"
  echo "created the demo tenant $tenant_id (main balance 10000)"
else
  echo "reusing the demo tenant $tenant_id (balances untouched)"
fi
api_key="$(field api_key "$tenant_file")"
bind="${ONCEPAY_BIND:-127.0.0.1:8130}"

# Card top-ups need a processor speaking Stripe's API: without ONCEPAY_PROCESSOR_URL, a local
# localstripe (scripts/localstripe.sh: PyPI, a virtualenv under the target dir) on
# ONCEPAY_LOCALSTRIPE_PORT (8420), fresh on every start, stopped with the server.
# ONCEPAY_LOCALSTRIPE=0 leaves top-ups unconfigured (501).
processor_note="ONCEPAY_PROCESSOR_URL=${ONCEPAY_PROCESSOR_URL:-}"
if [ -z "${ONCEPAY_PROCESSOR_URL:-}" ] && [ "${ONCEPAY_LOCALSTRIPE:-1}" != 0 ]; then
  port="${ONCEPAY_LOCALSTRIPE_PORT:-8420}"
  "$top/scripts/localstripe.sh" start "$port" "$demo/localstripe" >/dev/null
  trap '"$top/scripts/localstripe.sh" stop "$demo/localstripe"' EXIT
  export ONCEPAY_PROCESSOR_URL="http://127.0.0.1:$port"
  export ONCEPAY_PROCESSOR_API_KEY="${ONCEPAY_PROCESSOR_API_KEY:-sk_test_oncepay}"
  # A short wait for the emulator, so that the README's lost answer takes two seconds.
  export ONCEPAY_PROCESSOR_TIMEOUT_MS="${ONCEPAY_PROCESSOR_TIMEOUT_MS:-2000}"
  processor_note="localstripe on $ONCEPAY_PROCESSOR_URL (pid in .oncepay-demo/localstripe/)"
fi

cat <<TXT

  demo tenant : $tenant_id
  API key     : $api_key
  admin token : $ONCEPAY_ADMIN_TOKEN      (kept in .oncepay-demo/)
  tenant file : ${tenant_file#"$top/"}
  processor   : $processor_note

  Try it:
    curl -s -w '\n' -X POST http://$bind/pay -H "Authorization: Bearer $api_key" \\
         -H 'Content-Type: application/json' -H "Idempotency-Key: \$(cat /proc/sys/kernel/random/uuid)" \\
         -d '{"amount":100}'

  The server runs in this terminal until Ctrl-C. For the README's walkthrough, open a second
  terminal in $top and start with:
    eval "\$(make lab)"      # a new tenant with 10000: sets U, API, TENANT, ADMIN and STRIPE

TXT
# Not exec: the trap stops localstripe when the server stops.
"$bin" serve
