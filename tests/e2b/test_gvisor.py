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


def test_gvisor_sandboxes_of_a_crashed_server_without_their_records_are_reaped_at_restart():
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
    # ...and with no record of what the API knew of it the next server cannot adopt it (that
    # is test_restart.py's): it reaps it, runsc and the link holder included.
    os.remove(f"{STATE}/live/{sid}.json")
    srv2 = Server()
    try:
        assert not os.path.exists(f"{STATE}/gvisor/run/{sid}")
        assert not glob.glob(f"/sys/fs/cgroup/*/cordon/{sid}")
        assert not [p for p in os.listdir("/proc") if p.isdigit() and sid in _cmdline(p)]
    finally:
        srv2.stop()


def server_pid():
    """The `cordon serve` this suite talks to, found by its listening port."""
    port = API_URL.rsplit(":", 1)[1]
    for cmdline in os.listdir("/proc"):
        if not cmdline.isdigit():
            continue
        try:
            args = open(f"/proc/{cmdline}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and any(a.endswith(f":{port}".encode()) for a in args):
            return int(cmdline)
    raise AssertionError(f"no cordon serve listening on port {port}")


def zombie_children(pid):
    """The server's children that have exited and that nobody has waited for."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in open(f"/proc/{pid}/task/{task}/children").read().split():
            try:
                stat = open(f"/proc/{child}/stat").read()
            except OSError:
                continue
            if stat[stat.rindex(")") + 2] == "Z":
                out.append(int(child))
    return out


def test_gvisor_sandboxes_leave_no_zombies_in_the_server():
    # runsc's helpers exit during a start and its sandbox and gofer outlive `runsc run`: all
    # fall to the server (a child subreaper). Unreaped, each would hold a host pid for as long
    # as the server runs, a few per sandbox.
    pid = server_pid()
    before = set(zombie_children(pid))
    made = 3
    for _ in range(made):
        r = httpx.post(f"{API_URL}/sandboxes", headers={"X-API-KEY": API_KEY}, json={"templateID": "base", "tier": "gvisor", "timeout": 60}, timeout=60)
        assert r.status_code == 201, r.text
        sbx = Sandbox.connect(r.json()["sandboxID"])
        sbx.commands.run("true")
        sbx.kill()
    # Without a reaper each of these sandboxes left three zombies here; all of them must go
    # within the reaper's two periods.
    deadline = time.time() + 30
    while set(zombie_children(pid)) - before and time.time() < deadline:
        time.sleep(0.5)
    assert not set(zombie_children(pid)) - before, f"zombies left in the server: {zombie_children(pid)}"
