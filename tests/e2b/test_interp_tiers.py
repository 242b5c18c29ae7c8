"""The code interpreter under the other tiers: `code-interpreter-v1` with `tier: "gvisor"` and
`tier: "vm"` in the create body (a cordon extension the SDK does not send itself), then the real
`e2b-code-interpreter` connects and runs cells as on the `ns` tier (test_interp.py has the full
protocol there). One sandbox per tier for the whole module: a kernel under gVisor starts in
seconds, a VM under TCG in tens of seconds."""

import base64
import glob
import io
import os
import platform
import time

import httpx
import pytest
from e2b import TimeoutException
from e2b_code_interpreter import Sandbox
from PIL import Image

from conftest import API_KEY, API_URL, needs_qemu, needs_runsc

TEMPLATE = "code-interpreter-v1"



def create(tier, timeout):
    """Creates an interpreter sandbox of `tier` through the API and connects the SDK to it. The
    create answers only once the interpreter's port is open inside the sandbox."""
    started = time.monotonic()
    r = httpx.post(
        f"{API_URL}/sandboxes",
        headers={"X-API-KEY": API_KEY},
        json={"templateID": TEMPLATE, "tier": tier, "timeout": timeout, "metadata": {"suite": "cordon"}},
        # The first create of a tier may build the image, and under the vm tier its disk.
        timeout=1800,
    )
    assert r.status_code == 201, r.text
    print(f"{tier}: create of {TEMPLATE} took {time.monotonic() - started:.1f}s")
    return Sandbox.connect(r.json()["sandboxID"])


def gone(sid):
    r = httpx.get(f"{API_URL}/sandboxes/{sid}", headers={"X-API-KEY": API_KEY})
    return r.status_code == 404


@pytest.fixture(scope="module")
def gv():
    sbx = create("gvisor", 300)
    try:
        yield sbx
    finally:
        sbx.kill()
    assert gone(sbx.sandbox_id)


@needs_runsc
def test_gvisor_stdout_and_last_value(gv):
    # No retries: the first cell after create must find the interpreter up.
    ex = gv.run_code("import platform\nprint('hello from gvisor')\nplatform.release()")
    assert ex.error is None, ex.error
    assert ex.logs.stdout == ["hello from gvisor\n"]
    # gVisor's own kernel answers the kernel's uname, not the host's.
    assert ex.text and ex.text != platform.release(), ex.text
    [main] = [r for r in ex.results if r.is_main_result]
    assert main.text == ex.text
    assert gv.run_code("6 * 7").text == "42"


@needs_runsc
def test_gvisor_state_persists(gv):
    ctx = gv.create_code_context()
    try:
        first = gv.run_code("counter = 10", context=ctx)
        assert first.error is None and first.results == []
        second = gv.run_code("counter += 5\ncounter", context=ctx)
        assert second.text == "15"
        assert second.execution_count == first.execution_count + 1
        # Contexts are separate kernels under gVisor too.
        assert gv.run_code("counter").error.name == "NameError"
    finally:
        gv.remove_code_context(ctx)


@needs_runsc
def test_gvisor_error_has_its_name_and_traceback(gv):
    ex = gv.run_code("def divide(a, b):\n    return a / b\n\ndivide(1, 0)")
    assert ex.error is not None
    assert (ex.error.name, ex.error.value) == ("ZeroDivisionError", "division by zero")
    assert "return a / b" in ex.error.traceback, ex.error.traceback
    assert gv.run_code("'not sticky'").text == "not sticky"


@needs_runsc
def test_gvisor_matplotlib_png_decodes(gv):
    code = (
        "import matplotlib.pyplot as plt\n"
        "fig = plt.figure(figsize=(4, 3), dpi=100)\n"
        "plt.plot([1, 3, 2])\n"
        "plt.title('gvisor')\n"
        "plt.show()\n"
    )
    ex = gv.run_code(code, timeout=120)
    assert ex.error is None, ex.error
    [png] = [r for r in ex.results if r.png]
    img = Image.open(io.BytesIO(base64.b64decode(png.png, validate=True)))
    img.load()  # decodes every pixel: a truncated or corrupt PNG fails here
    assert img.format == "PNG" and img.size == (400, 300)
    assert len(img.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 10


@needs_runsc
def test_gvisor_runaway_cell_times_out_and_the_next_cell_works(gv):
    ctx = gv.create_code_context()
    try:
        gv.run_code("survivor = 'still here'", context=ctx)
        started = time.monotonic()
        with pytest.raises(TimeoutException):
            gv.run_code("while True:\n    pass", context=ctx, timeout=2)
        assert time.monotonic() - started < 10
        # The disconnect interrupted the loop (SIGINT through gVisor's kernel): state lives on.
        ex = gv.run_code("survivor", context=ctx, timeout=30)
        assert ex.error is None and ex.text == "still here"
    finally:
        gv.remove_code_context(ctx)


@needs_runsc
def test_gvisor_kernel_is_confined_like_any_process(gv):
    code = (
        "import os, socket\n"
        "print(os.getuid(), os.getgid())\n"
        "try:\n"
        "    socket.create_connection(('198.51.100.7', 80), timeout=3)\n"
        "    print('connected')\n"
        "except OSError as e:\n"
        "    print('no network:', e.errno)\n"
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
    )
    ex = gv.run_code(code)
    assert ex.error is None, ex.error
    uid, net, capeff = "".join(ex.logs.stdout).splitlines()
    assert uid == "1000 1000"
    # The sandbox's no-network default holds for the kernel: gVisor's netstack has loopback only.
    assert net.startswith("no network:"), net
    assert int(capeff, 16) == 0


@needs_runsc
def test_gvisor_memory_bomb_ends_the_whole_sandbox(gv):
    # Decided behaviour, unlike the ns tier (where the kernel dies and the sandbox lives on):
    # gVisor has no OOM killer of its own (google/gvisor#1967, #2533), so the host's, at the
    # sandbox's memory cap, kills the runsc process that holds all of the sandbox's memory. The
    # sandbox is then clearly dead: the cell's request fails, the sandbox leaves the API, nothing
    # of it stays on the host, and other sandboxes carry on.
    victim = create("gvisor", 120)
    sid = victim.sandbox_id
    assert victim.run_code("1 + 1").text == "2"
    # The SDK words it by what it saw first: the stream cut ("killed"), the proxy's connection
    # to the dying sandbox cut ("connection closed"), or the sandbox already gone from the API
    # ("not found"). The checks below prove which: it is gone.
    with pytest.raises(TimeoutException, match="killed|was not found|did not answer on port 49999: connection closed"):
        victim.run_code("blocks = []\nwhile True:\n    blocks.append(b'x' * (32 << 20))", timeout=120)
    deadline = time.monotonic() + 15
    while not gone(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone(sid)
    # The sandbox leaves the API first (its traffic stops at once), then the host tears it down:
    # the cgroup can only go once the kernel has reaped every process in it. Wait for that,
    # bounded, and say how long it took; a leak fails here.
    left = time.monotonic()
    leftovers = lambda: glob.glob(f"/sys/fs/cgroup/*/cordon/{sid}") + [p for p in os.listdir("/proc") if p.isdigit() and sid in _cmdline(p)]
    while leftovers() and time.monotonic() - left < 60:
        time.sleep(0.2)
    print(f"host cleanup finished {time.monotonic() - left:.1f}s after the sandbox left the API")
    assert not leftovers(), leftovers()
    assert gv.run_code("'unaffected'").text == "unaffected"


def start_processes(sbx):
    """The pids of the template's start command (the interpreter's server), tagged `start`."""
    pids = sorted(p.pid for p in sbx.commands.list() if p.tag == "start")
    assert pids, "the interpreter's server runs as the `start` process"
    return pids


@needs_runsc
def test_gvisor_interpreter_keeps_its_kernel_across_a_pause():
    # Its own sandbox: the module's is not paused under the other tests. runsc checkpoints the
    # whole sandbox to disk, the interpreter's loopback sockets with it.
    sbx = create("gvisor", 300)
    try:
        assert sbx.run_code("kept = 40").error is None
        before = start_processes(sbx)
        assert len(before) == 1
        assert sbx.pause()
        sbx.connect()
        assert sbx.run_code("kept + 2").text == "42", "the kernel's variables survive the pause"
        assert start_processes(sbx) == before, "a resume with memory must not start the template's service again"
    finally:
        sbx.kill()
    assert gone(sbx.sandbox_id)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


@needs_qemu
def test_vm_interpreter_value_and_state():
    # The costliest test of the suite under TCG (no KVM here; about 70 s, most of it the
    # interpreter and its first kernel starting on an emulated CPU after a 10 s boot; the
    # image's disk is made once, in about 25 s). One VM for the whole test.
    sbx = create("vm", 600)
    try:
        ex = sbx.run_code("import platform\nprint('hello from a vm')\nplatform.release()", timeout=120)
        assert ex.error is None, ex.error
        assert ex.logs.stdout == ["hello from a vm\n"]
        # The guest's own Debian kernel.
        assert ex.text != platform.release() and "cloud-amd64" in ex.text, ex.text
        assert sbx.run_code("kept = 20", timeout=120).error is None
        assert sbx.run_code("kept + 1", timeout=120).text == "21"
        # Paused with its memory to disk and resumed: the same kernel holds `kept`, and the
        # interpreter's server is the one from before (not started a second time).
        before = start_processes(sbx)
        assert sbx.pause()
        sbx.connect(timeout=600)
        assert sbx.run_code("kept + 2", timeout=120).text == "22"
        assert start_processes(sbx) == before
    finally:
        sbx.kill()
    assert gone(sbx.sandbox_id)
