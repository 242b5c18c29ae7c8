"""The server process itself: the concurrency limit, SIGTERM cleanup, and reaping after a crash
what cannot be adopted (adoption itself: test_restart.py).
Each test starts its own `cordon serve` (the binary run.sh exports as CORDON_BIN)."""

import os
import signal
import subprocess
import time
import urllib.request

import pytest
from e2b import RateLimitException, Sandbox

from conftest import free_port

STATE = os.environ.get("CORDON_HOME", "/var/lib/cordon")
KEY = "e2b_" + "1" * 40


class Server:
    def __init__(self, *args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [os.environ["CORDON_BIN"], "serve", "--listen", f"127.0.0.1:{self.port}", "--api-key", KEY, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for _ in range(100):
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise AssertionError(self.proc.stderr.read().decode())
                time.sleep(0.1)
        raise AssertionError("server did not start")

    def create(self, **kw):
        return Sandbox.create(api_key=KEY, api_url=self.url, sandbox_url=self.url, timeout=60, **kw)

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)


def agent_pid(sandbox_id):
    import json

    with open(f"{STATE}/run/{sandbox_id}/record.json") as f:
        return json.load(f)["pid"]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_concurrency_limit_is_rate_limit():
    srv = Server("--max-sandboxes", "1")
    try:
        start = time.time()
        first = srv.create()
        one_create = time.time() - start
        start = time.time()
        with pytest.raises(RateLimitException):
            srv.create()
        # The SDK's retries back off for seconds; a refusal it does not retry costs about one
        # request, bounded against the create this machine just served.
        assert time.time() - start < 2 + 2 * one_create, "Should-Retry: false must stop the SDK's retries"
        first.kill()
        srv.create().kill()
    finally:
        srv.stop()


def test_sigterm_destroys_every_sandbox():
    srv = Server("--shutdown", "destroy")
    ids = [srv.create().sandbox_id for _ in range(2)]
    pids = [agent_pid(i) for i in ids]
    assert all(alive(p) for p in pids)
    assert srv.stop(signal.SIGTERM) == 0
    for i, p in zip(ids, pids):
        assert not os.path.exists(f"{STATE}/run/{i}")
        assert not alive(p)


def test_crash_then_restart_reaps_a_sandbox_left_without_its_record():
    srv = Server()
    sid = srv.create().sandbox_id
    pid = agent_pid(sid)
    srv.stop(signal.SIGKILL)
    # The sandbox outlives its server...
    assert os.path.exists(f"{STATE}/run/{sid}")
    assert alive(pid)
    # ...and with no record of what the API knew of it (lost, or never written: a pooled
    # sandbox nobody took), the next server cannot adopt it: it is reaped, not leaked.
    os.remove(f"{STATE}/live/{sid}.json")
    srv2 = Server()
    try:
        assert not os.path.exists(f"{STATE}/run/{sid}")
        for _ in range(50):
            if not alive(pid):
                break
            time.sleep(0.1)
        assert not alive(pid)
    finally:
        srv2.stop()
