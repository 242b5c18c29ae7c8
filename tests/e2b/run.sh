#!/usr/bin/env bash
# The E2B SDK suite: the real `e2b` package from PyPI, in tests/e2b/.venv (created once, reused),
# against a `cordon serve` started here on a free port with a fixed API key and the default
# state dir (where the `base` image is cached). Exits with pytest's status. With no arguments it
# then runs the old-SDK smoke suite and the JavaScript SDK suite (tests/e2b/js, npm `e2b`) against
# the same server, and fails if any of them does.
#
#   tests/e2b/run.sh [pytest args...]       CORDON_BIN=... to pick the binary, E2B_UPGRADE=1 to
#                                           upgrade the SDK to its latest release first
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin="${CORDON_BIN:-${CARGO_TARGET_DIR:-$root/target}/x86_64-unknown-linux-gnu/release/cordon}"
[ -x "$bin" ] || { echo "tests/e2b: $bin not found: build with cargo build --release (or set CORDON_BIN)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "tests/e2b: skipped: cordon serve needs root" >&2; exit 0; }

venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
    # Debian splits venv support (ensurepip) into its own package.
    if ! python3 -c 'import ensurepip' 2>/dev/null; then
        echo "tests/e2b: installing python3-venv" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y --no-install-recommends python3-venv >/dev/null 2>&1 || {
            apt-get update -qq
            apt-get install -y --no-install-recommends python3-venv
        }
    fi
    python3 -m venv "$venv"
fi
if [ "${E2B_UPGRADE:-0}" = 1 ] || ! "$venv/bin/python" -c 'import e2b, e2b_code_interpreter, PIL, pytest, pytest_asyncio, httpx, hypercorn, prometheus_client, websocket, kubernetes_validate, yaml' 2>/dev/null; then
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q --upgrade -r "$here/requirements.txt"
fi
echo "tests/e2b: e2b $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("e2b"), "code-interpreter", m.version("e2b-code-interpreter"))')"
# An older SDK, for a smoke test of the endpoints and wire forms it uses.
venv_old="$here/.venv-old"
[ -x "$venv_old/bin/python" ] || python3 -m venv "$venv_old"
"$venv_old/bin/python" -c 'import e2b, pytest' 2>/dev/null || "$venv_old/bin/pip" install -q -r "$here/old/requirements.txt"

port="$("$venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
key="e2b_$(printf '0%.0s' $(seq 40))"
# Every server of the suite ends its sandboxes when stopped, so that the suite leaves nothing
# running; test_restart.py asks for `--shutdown keep` itself.
export CORDON_SHUTDOWN=destroy
log="$(mktemp /tmp/cordon-serve-XXXXXX.log)"
"$bin" serve --listen "127.0.0.1:$port" --api-key "$key" --max-sandboxes 50 --prebuild base code-interpreter-v1 >"$log" 2>&1 &
server=$!
stop() {
    if kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"
        wait "$server" || true
    fi
}
trap stop EXIT
# A first start builds the two images before it listens (--prebuild, a few minutes once): wait
# while the server lives, up to 15 minutes.
for _ in $(seq 9000); do
    "$venv/bin/python" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null && break
    kill -0 "$server" 2>/dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.1
done

export CORDON_BIN="$bin"
# The server's log, for tests that check what it does not write (a secret's value).
export CORDON_SERVE_LOG="$log"
export E2B_API_KEY="$key" E2B_API_URL="http://127.0.0.1:$port" E2B_SANDBOX_URL="http://127.0.0.1:$port" E2B_VOLUME_API_URL="http://127.0.0.1:$port"
status=0
(cd "$here" && "$venv/bin/python" -m pytest --ignore=old "$@") || status=$?
if [ "$#" = 0 ]; then
    (cd "$here/old" && "$venv_old/bin/python" -m pytest -q -p no:cacheprovider .) || status=$?
    # The JavaScript SDK, at the version package-lock.json pins, against the same server and env.
    # Node is not part of the Rust toolchain: a machine without it skips this part, not the run.
    js="$here/js"
    if ! command -v node >/dev/null 2>&1; then
        echo "tests/e2b: js SDK tests skipped: node is not installed" >&2
    else
        js_ready=1
        # `npm ci` deletes node_modules and installs afresh, so only when it is missing or older
        # than the lock file (npm writes node_modules/.package-lock.json on every install).
        if [ ! -d "$js/node_modules/e2b" ] || [ "$js/package-lock.json" -nt "$js/node_modules/.package-lock.json" ]; then
            (cd "$js" && npm ci --no-audit --no-fund) || { status=$?; js_ready=0; }
        fi
        if [ "$js_ready" = 1 ]; then
            echo "tests/e2b: js e2b $(node -p "require('$js/node_modules/e2b/package.json').version")"
            (cd "$root" && node --test tests/e2b/js/) || status=$?
        fi
    fi
fi
stop
trap - EXIT
if [ "$status" != 0 ]; then
    echo "tests/e2b: failed; server log: $log" >&2
else
    rm -f "$log"
fi
exit "$status"
