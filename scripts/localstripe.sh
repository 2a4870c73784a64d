#!/usr/bin/env bash
# The card processor of the tests, `make run` and the README: localstripe (PyPI), a stateful
# emulator of Stripe's API that nobody here wrote, installed into a virtualenv under the
# cargo target directory. It ignores `Idempotency-Key`, which is what the tests want: oncepay
# must not depend on the processor deduplicating.
#
#   scripts/localstripe.sh install          the virtualenv (once); prints the executable's path
#   scripts/localstripe.sh start PORT DIR   localstripe --from-scratch on PORT, in DIR (it listens on
#                                           every interface: it has no option for one; callers
#                                           reach it on 127.0.0.1)
#                                           (one DIR per instance, for its pid and log); prints its
#                                           pid. It writes its state to the fixed
#                                           /tmp/localstripe.pickle but, started --from-scratch,
#                                           never reads it back: every start begins empty
#   scripts/localstripe.sh stop DIR         stops the instance started in DIR
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
version="1.15.10"
target="${CARGO_TARGET_DIR:-$top/target}"
venv="$target/localstripe-venv"
exe="$venv/bin/localstripe"

install() {
  # One installer at a time (tests start many instances at once); the others wait, then find it.
  mkdir -p "$target"
  exec 9>"$target/localstripe-venv.lock"
  flock 9
  # The version read in full first: `pip show | grep -q` under pipefail fails whenever grep
  # exits before pip finishes writing (SIGPIPE), and the venv in use was then rebuilt under
  # the feet of running tests.
  local installed=""
  [ -x "$exe" ] && installed="$("$venv/bin/pip" show localstripe 2>/dev/null | sed -n 's/^Version: //p')" || true
  if [ "$installed" != "$version" ]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "localstripe==$version" >&2
  fi
  flock -u 9
  echo "$exe"
}

case "${1:-}" in
  install) install ;;
  start)
    port="$2"; dir="$3"
    install >/dev/null
    mkdir -p "$dir"
    cd "$dir"
    nohup "$exe" --port "$port" --from-scratch >"$dir/localstripe.log" 2>&1 &
    echo $! >"$dir/localstripe.pid"
    # Refused connections are expected while it starts: curl stays quiet (-s without -S), and
    # only a start that never answers is reported.
    for _ in $(seq 1 100); do
      if curl -fs -o /dev/null -u sk_test_oncepay: "http://127.0.0.1:$port/v1/payment_intents" 2>/dev/null; then
        cat "$dir/localstripe.pid"; exit 0
      fi
      sleep 0.1
    done
    echo "localstripe did not answer on port $port (log: $dir/localstripe.log)" >&2
    exit 1
    ;;
  stop)
    dir="$2"
    if [ -f "$dir/localstripe.pid" ]; then
      kill "$(cat "$dir/localstripe.pid")" 2>/dev/null || true
      rm -f "$dir/localstripe.pid"
    fi
    ;;
  *) echo "usage: $0 install | start PORT DIR | stop DIR" >&2; exit 2 ;;
esac
