#!/usr/bin/env bash
# `make lab`: a new tenant "lab" (policy reject, account main with 10000) on the local database
# of `make run`, and the shell lines that point the README's walkthrough at it:
#
#   eval "$(make lab)"     # sets U (the server's URL), API (its API key), TENANT, ADMIN, STRIPE
#
# Each run makes another tenant, so the walkthrough's balances and keys start afresh every time;
# the demo tenant of `make run` is left as it is. ADMIN is ONCEPAY_ADMIN_TOKEN when set, else the
# token `make run` keeps in .oncepay-demo/. Only the shell lines go to stdout.
set -euo pipefail
bin="$1"
top="$(cd "$(dirname "$0")/.." && pwd)"

admin="${ONCEPAY_ADMIN_TOKEN:-}"
if [ -z "$admin" ]; then
  [ -s "$top/.oncepay-demo/admin_token" ] || {
    echo "make lab: no admin token in .oncepay-demo/: start the server with make run first" >&2
    exit 1
  }
  admin="$(cat "$top/.oncepay-demo/admin_token")"
fi

tenant="$("$bin" tenant create --name lab --main-balance 10000)"
field() { sed -n "s/.*\"$1\":\"\\([^\"]*\\)\".*/\\1/p" <<<"$tenant"; }
echo "make lab: created the tenant lab $(field tenant_id) (main balance 10000)" >&2

cat <<SH
export U=http://${ONCEPAY_BIND:-127.0.0.1:8130}
export API=$(field api_key)
export TENANT=$(field tenant_id)
export ADMIN=$admin
export STRIPE=${ONCEPAY_PROCESSOR_URL:-http://127.0.0.1:${ONCEPAY_LOCALSTRIPE_PORT:-8420}}
SH
