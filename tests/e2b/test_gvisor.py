"""The gvisor tier through the API: `tier: "gvisor"` in the create body (a cordon extension the
SDK does not send itself), then the real SDK connects and works as with any other sandbox:
commands, files, and a server inside reached through the port forwarding, all over the agent's
one multiplexed link."""

import os
import platform
import time

import httpx
from e2b import Sandbox

from conftest import API_KEY, API_URL, BASE_URL, needs_runsc

pytestmark = needs_runsc


def test_gvisor_sandbox_through_the_sdk():
    r = httpx.post(
        f"{API_URL}/sandboxes",
        headers={"X-API-KEY": API_KEY},
        json={"templateID": "base", "tier": "gvisor", "timeout": 120},
        timeout=60,
    )
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    sbx = Sandbox.connect(sid)
    try:
        out = sbx.commands.run("uname -r; hostname; id -u")
        kernel, hostname, uid = out.stdout.split()
        # gVisor's own kernel answers, not the host's.
        assert kernel != platform.release(), out.stdout
        assert (hostname, uid) == (sid, "1000")
        sbx.files.write("/home/user/www/hello.txt", "from gvisor")
        assert sbx.files.read("/home/user/www/hello.txt") == "from gvisor"
        sbx.commands.run("cd /home/user/www && python3 -m http.server 8080", background=True)
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8080"}
        for _ in range(100):
            r = httpx.get(BASE_URL + "/hello.txt", headers=headers)
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert r.status_code == 200 and r.text == "from gvisor", r.text
    finally:
        sbx.kill()
    r = httpx.get(f"{API_URL}/sandboxes/{sid}", headers={"X-API-KEY": API_KEY})
    assert r.status_code == 404


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def test_gvisor_sandboxes_of_a_crashed_server_are_reaped_at_restart():
    import glob
    import signal

    from test_server import KEY, STATE, Server

    srv = Server()
    r = httpx.post(f"{srv.url}/sandboxes", headers={"X-API-KEY": KEY}, json={"tier": "gvisor", "timeout": 60}, timeout=60)
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    srv.stop(signal.SIGKILL)
    # No teardown ran: the sandbox's state and cgroups are still there...
    assert os.path.exists(f"{STATE}/gvisor/run/{sid}")
    assert glob.glob(f"/sys/fs/cgroup/*/cordon/{sid}")
    # ...until the next server starts and reaps them.
    srv2 = Server()
    try:
        assert not os.path.exists(f"{STATE}/gvisor/run/{sid}")
        assert not glob.glob(f"/sys/fs/cgroup/*/cordon/{sid}")
        assert not [p for p in os.listdir("/proc") if p.isdigit() and sid in _cmdline(p)]
    finally:
        srv2.stop()
