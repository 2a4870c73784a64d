#!/usr/bin/env bash
# Verifies recorded webhook messages with the Standard Webhooks reference verifier (the PyPI
# package `standardwebhooks`, installed once into a venv under the cargo target folder).
# Input: a JSON file of [{"secret","headers":{...},"body_base64"}]; prints `verified=N` and
# exits non-zero, naming the message, when one does not verify. Used by `make chaos`
# (tests/chaos/webhooks.rs); runnable by hand on any such file.
set -euo pipefail
file="${1:?usage: scripts/standardwebhooks-verify.sh messages.json}"
venv="${ONCEPAY_SWH_VENV:-${CARGO_TARGET_DIR:-$(dirname "$0")/../target}/standardwebhooks-venv}"
if ! "$venv/bin/python" -c 'import standardwebhooks' >/dev/null 2>&1; then
  echo "installing standardwebhooks 1.1.0 from PyPI into $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  timeout 300 "$venv/bin/pip" install -q 'standardwebhooks==1.1.0' >&2
fi
exec "$venv/bin/python" - "$file" <<'PY'
import base64, json, sys
from standardwebhooks.webhooks import Webhook

messages = json.load(open(sys.argv[1]))
for m in messages:
    body = base64.b64decode(m["body_base64"])
    try:
        Webhook(m["secret"]).verify(body, m["headers"])
    except Exception as err:  # the reference verifier's refusal, named
        print(f"not verified: {m['headers'].get('webhook-id')}: {err!r}", file=sys.stderr)
        sys.exit(1)
print(f"verified={len(messages)}")
PY
