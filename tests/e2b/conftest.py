"""Fixtures for the E2B SDK suite. `run.sh` starts `cordon serve` and sets E2B_API_KEY,
E2B_API_URL and E2B_SANDBOX_URL; every test talks to it through the real `e2b` package."""

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid

import httpx
import pytest
from e2b import Sandbox

for var in ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL"):
    if not os.environ.get(var):
        raise RuntimeError(f"{var} is not set: run this suite through tests/e2b/run.sh")

# Tests of the other tiers skip, saying why, where the host lacks their runtime.
needs_runsc = pytest.mark.skipif(
    not (os.environ.get("CORDON_RUNSC") or shutil.which("runsc")), reason="runsc is not installed (scripts/install-deps)"
)
needs_qemu = pytest.mark.skipif(
    not (os.environ.get("CORDON_QEMU") or shutil.which("qemu-system-x86_64")),
    reason="qemu-system-x86_64 is not installed (scripts/install-deps)",
)

BASE_URL = os.environ["E2B_SANDBOX_URL"]
API_URL = os.environ["E2B_API_URL"]
API_KEY = os.environ["E2B_API_KEY"]

# A command that makes bpf(2), which the ns tier's filter denies, and prints the errno it failed
# with: 1 (EPERM) where the host records the denial, 38 (ENOSYS) once that listener is gone.
DENIED_SYSCALL = "python3 -c \"import ctypes; l=ctypes.CDLL(None, use_errno=True); l.syscall(321, 0, 0, 0); print(ctypes.get_errno())\""


@pytest.fixture
def sandbox():
    """A fresh sandbox per test, killed afterwards even when the test fails."""
    sbx = Sandbox.create(timeout=120, metadata={"suite": "cordon"})
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture(scope="module")
def shared():
    """One sandbox for tests that only read or write their own paths."""
    sbx = Sandbox.create(timeout=300, metadata={"suite": "cordon"})
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture
def unique():
    return uuid.uuid4().hex


def free_port():
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(cond, what, secs=60, every=0.05):
    """`cond()`'s first truthy value, polled every `every` seconds for at most `secs`; fails
    naming `what` and the last value seen."""
    deadline = time.monotonic() + secs
    got = None
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"not within {secs} s: {what}; last: {got!r}")


class Serve:
    """Another `cordon serve` (the binary run.sh exports as CORDON_BIN) on a port of its own, with
    the suite's API key and whatever extra `args` (a restart, another state dir, a flag the suite's
    server lacks). Its output goes to `log` (a file opened for writing), or nowhere."""

    def __init__(self, *args, log=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log = log
        self.proc = None

    def start(self):
        out = self.log if self.log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [os.environ["CORDON_BIN"], "serve", "--listen", f"127.0.0.1:{self.port}", "--api-key", API_KEY, *self.args],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        for _ in range(600):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, "the second server exited"
            time.sleep(0.1)
        raise AssertionError("the second server did not start")

    def stop(self, sig=signal.SIGTERM):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)

    def api(self, method, path, **kw):
        return httpx.request(method, self.url + path, headers={"X-API-KEY": API_KEY}, timeout=120, **kw)

    def sdk(self):
        """Keyword arguments that point the SDK at this server."""
        return {"api_url": self.url, "sandbox_url": self.url, "api_key": API_KEY}


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def route_dev(ip):
    """The device the host routes `ip` through ("" when none): a test address must route only
    to the namespace the test made."""
    parts = sh("ip", "route", "get", ip, check=False).stdout.split()
    return parts[parts.index("dev") + 1] if "dev" in parts else ""
