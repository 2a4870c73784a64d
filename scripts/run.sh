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

tenant_id=""
if [ -s "$demo/tenant.json" ]; then
  tenant_id="$(sed -n 's/.*"tenant_id":"\([^"]*\)".*/\1/p' "$demo/tenant.json")"
  exists="$(psql -X -qtA "$DATABASE_URL" -c "SELECT 1 FROM tenants WHERE tenant_id = '$tenant_id'" 2>/dev/null || true)"
  [ "$exists" = 1 ] || tenant_id=""
fi
if [ -z "$tenant_id" ]; then
  "$bin" tenant create --name demo --main-balance 10000 >"$demo/tenant.json"
  chmod 600 "$demo/tenant.json"
  tenant_id="$(sed -n 's/.*"tenant_id":"\([^"]*\)".*/\1/p' "$demo/tenant.json")"
  echo "created the demo tenant $tenant_id (main balance 10000)"
else
  echo "reusing the demo tenant $tenant_id (balances untouched)"
fi
api_key="$(sed -n 's/.*"api_key":"\([^"]*\)".*/\1/p' "$demo/tenant.json")"
bind="${ONCEPAY_BIND:-127.0.0.1:8130}"

cat <<TXT

  demo tenant : $tenant_id
  API key     : $api_key
  admin token : $ONCEPAY_ADMIN_TOKEN      (kept in .oncepay-demo/)

  Try it:
    curl -s -w '\n' -X POST http://$bind/pay -H "Authorization: Bearer $api_key" \\
         -H 'Content-Type: application/json' -H "Idempotency-Key: \$(cat /proc/sys/kernel/random/uuid)" \\
         -d '{"amount":100}'

  The server runs in this terminal until Ctrl-C. For the README's walkthrough, open a second
  terminal in $top and start with:
    eval "\$(make lab)"      # a new tenant with 10000: sets U, API, TENANT and ADMIN

TXT
exec "$bin" serve
