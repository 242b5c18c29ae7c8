"""Sandboxes that keep their state, through the real SDK: pause with memory (frozen in place:
same processes, PIDs, listeners and boot), pause to files (a fresh boot on the same files),
resume by connect or by traffic, lifecycle auto-pause, snapshots and forks, and what a kill of
a paused sandbox leaves on disk (nothing). Host-side checks read the sandbox's own cgroup and
the server's state dir, where the harm of a broken pause would show.

The restart tests start a second `cordon serve` on the same state dir (run.sh's server keeps
running) and kill it, gently or with SIGKILL in the middle of a pause or a fork."""

import glob
import json
import os
import signal
import threading
import time
from datetime import datetime, timezone

import httpx
import pytest
from e2b import Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import SandboxException, SandboxNotFoundException

from conftest import API_KEY, API_URL, BASE_URL, Serve, needs_runsc

STATE_DIR = os.environ.get("CORDON_HOME", "/var/lib/cordon")
HEADERS = {"X-API-KEY": API_KEY}


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def host_cpu_usec(sid):
    """CPU the sandbox's processes used so far, from its cgroup on the host (v1 or v2)."""
    v1 = _read(f"/sys/fs/cgroup/cpu,cpuacct/cordon/{sid}/cpuacct.usage") or _read(f"/sys/fs/cgroup/cpuacct/cordon/{sid}/cpuacct.usage")
    if v1 is not None:
        return int(v1) // 1000
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        stat = _read(f"{root}/cordon/{sid}/cpu.stat")
        if stat:
            for line in stat.splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1])
    raise AssertionError(f"no cpu accounting found for sandbox {sid}")


def host_memory_bytes(sid):
    v1 = _read(f"/sys/fs/cgroup/memory/cordon/{sid}/memory.usage_in_bytes")
    if v1 is not None:
        return int(v1)
    v2 = _read(f"/sys/fs/cgroup/cordon/{sid}/memory.current")
    assert v2 is not None, f"no memory accounting found for sandbox {sid}"
    return int(v2)


def hold_64mib(sbx, marker):
    """Starts a process that touches 64 MiB and keeps it; returns once it has (it then makes
    `marker`). The wait is bounded by a deadline only: an emulated guest is slow."""
    sbx.commands.run(f"python3 -c 'import time; b = bytearray(64 << 20); b[::4096] = b\"x\" * len(b[::4096]); open(\"{marker}\", \"w\").close(); time.sleep(3600)'", background=True)
    for _ in range(600):
        if sbx.files.exists(marker):
            return
        time.sleep(0.1)
    raise AssertionError(f"the process holding 64 MiB did not start ({marker} never appeared)")


def assert_deleted_soon(pattern, within=30.0):
    """What a resume deletes after its answer (its saved memory, renamed to `.gone-*` first) is
    gone within `within` seconds; the wait is a deadline only."""
    deadline = time.monotonic() + within
    while glob.glob(pattern) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert glob.glob(pattern) == [], f"{pattern} is still there {within} s after the resume"


def saved_state(sid):
    """What the server keeps on disk of sandbox `sid`: its record and its images."""
    return glob.glob(f"{STATE_DIR}/paused/{sid}.json") + glob.glob(f"{STATE_DIR}/images/*-{sid}-*")


def wait_http(url, headers, want=200, tries=150):
    r = None
    for _ in range(tries):
        try:
            r = httpx.get(url, headers=headers, timeout=5)
            if r.status_code == want:
                return r
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered {want}: {r and r.status_code} {r and r.text}")


def test_memory_pause_keeps_processes_and_uses_no_cpu():
    sbx = Sandbox.create(timeout=120, metadata={"suite": "cordon-state"})
    sid = sbx.sandbox_id
    try:
        sleeper = sbx.commands.run("sleep 3600", background=True)
        sbx.files.write("/home/user/www/index.html", "before the pause")
        sbx.commands.run("cd /home/user/www && python3 -m http.server 8000", background=True)
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"}
        wait_http(BASE_URL + "/index.html", headers)
        # A busy loop, so that a pause that does not stop the sandbox shows on its CPU counter,
        # and 64 MiB held, which must stay resident and counted against its cap.
        sbx.commands.run("python3 -c 'while True: pass'", background=True)
        sbx.commands.run("python3 -c 'import time; b = bytearray(64 << 20); b[::4096] = b\"x\" * len(b[::4096]); time.sleep(3600)'", background=True)
        # A background job that ends after the resume.
        sbx.commands.run("sleep 2; echo done > /home/user/job", background=True)
        boot = sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
        time.sleep(0.5)

        assert sbx.pause() is True
        assert sbx.pause() is False, "a second pause must say it was already paused"
        assert not sbx.is_running()
        info = Sandbox.get_info(sid)
        assert info.state == SandboxState.PAUSED
        # A paused sandbox's end is its pause.
        assert info.end_at <= datetime.now(timezone.utc)
        raw = httpx.get(f"{API_URL}/sandboxes/{sid}", headers=HEADERS).json()
        assert raw["pauseMode"] == "full" and raw["lifecycle"] == {"autoResume": False, "onTimeout": "kill"}
        paused = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()]
        assert sid in paused
        # Frozen: no CPU over a window as long as the one in which the loop ran before.
        before = host_cpu_usec(sid)
        time.sleep(1.0)
        assert host_cpu_usec(sid) == before, "a paused sandbox used CPU"
        assert host_memory_bytes(sid) >= 64 << 20, "a paused sandbox's memory must stay counted against its cap"
        # The data plane answers as for a missing sandbox while paused, and the deadline stops.
        r = httpx.get(BASE_URL + "/index.html", headers=headers)
        assert r.status_code == 502, r.text
        with pytest.raises(SandboxNotFoundException):
            Sandbox.set_timeout(sid, 60)

        same = sbx.connect()
        assert same.sandbox_id == sid and sbx.is_running()
        assert sbx.commands.run(f"kill -0 {sleeper.pid} && echo alive").stdout.strip() == "alive"
        assert sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout == boot
        assert wait_http(BASE_URL + "/index.html", headers).text == "before the pause"
        for _ in range(100):
            if sbx.files.exists("/home/user/job"):
                break
            time.sleep(0.1)
        assert sbx.files.read("/home/user/job").strip() == "done"
        assert Sandbox.get_info(sid).state == SandboxState.RUNNING
    finally:
        sbx.kill()
    assert saved_state(sid) == []


def test_a_paused_sandboxes_timeout_does_not_run():
    sbx = Sandbox.create(timeout=3)
    try:
        sbx.commands.run("sleep 3600", background=True)
        assert sbx.pause()
        time.sleep(5)
        # Past its deadline, but paused: still there, and resumable.
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        sbx.connect(timeout=60)
        assert sbx.commands.run("echo up").stdout.strip() == "up"
    finally:
        sbx.kill()


def test_filesystem_pause_keeps_files_and_frees_the_processes():
    sbx = Sandbox.create(timeout=120, metadata={"suite": "cordon-state", "kind": "fs"})
    sid = sbx.sandbox_id
    try:
        sbx.commands.run("mkdir -p /home/user/data/deep && echo kept > /home/user/data/deep/f && chmod 640 /home/user/data/deep/f")
        sbx.commands.run("sudo sh -c 'echo root-owned > /opt/r && chmod 600 /opt/r'")
        sbx.commands.run("sudo rm /etc/motd || true")
        sleeper = sbx.commands.run("sleep 3600", background=True)
        boot = sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
        before = sbx.commands.run("stat -c '%U %G %a' /home/user/data/deep/f /opt/r").stdout

        assert sbx.pause(mode="filesystem") is True
        assert sbx.pause(mode="filesystem") is False
        # Its processes are gone from the host: no cgroup, no kept mount.
        assert not os.path.exists(f"/sys/fs/cgroup/memory/cordon/{sid}")
        assert sid not in _read("/proc/mounts")
        raw = httpx.get(f"{API_URL}/sandboxes/{sid}", headers=HEADERS).json()
        assert raw["state"] == "paused" and raw["pauseMode"] == "filesystem", raw
        assert raw["metadata"] == {"suite": "cordon-state", "kind": "fs"}
        assert not sbx.is_running()
        assert saved_state(sid), "a paused sandbox's files must be on disk"

        sbx.connect()
        assert sbx.sandbox_id == sid
        assert sbx.files.read("/home/user/data/deep/f").strip() == "kept"
        assert sbx.commands.run("stat -c '%U %G %a' /home/user/data/deep/f /opt/r").stdout == before
        assert not sbx.files.exists("/etc/motd"), "a deletion must stay deleted"
        assert sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout != boot, "a filesystem resume is a fresh boot"
        r = sbx.commands.run(f"kill -0 {sleeper.pid} 2>/dev/null && echo alive || echo gone")
        assert r.stdout.strip() == "gone"
        # Pause and resume again: files written since the first resume are kept too.
        sbx.files.write("/home/user/second", "2")
        assert sbx.pause(mode="filesystem")
        sbx.connect()
        assert sbx.files.read("/home/user/second") == "2" and sbx.files.read("/home/user/data/deep/f").strip() == "kept"
    finally:
        sbx.kill()
    assert saved_state(sid) == [], "kill of a paused sandbox must delete its saved state"


def test_kill_of_a_filesystem_paused_sandbox_deletes_everything():
    sbx = Sandbox.create(timeout=120)
    sid = sbx.sandbox_id
    sbx.files.write("/home/user/big", os.urandom(1 << 20))
    assert sbx.pause(mode="filesystem")
    layers_before = set(os.listdir(f"{STATE_DIR}/layers/sha256"))
    assert saved_state(sid)
    assert Sandbox.kill(sid) is True
    assert saved_state(sid) == []
    assert Sandbox.kill(sid) is False
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sid)
    # The layer made of its files went with it.
    assert len(set(os.listdir(f"{STATE_DIR}/layers/sha256"))) < len(layers_before)


def test_auto_pause_at_timeout_and_auto_resume_on_traffic():
    sbx = Sandbox.create(timeout=4, lifecycle={"on_timeout": "pause", "auto_resume": True})
    sid = sbx.sandbox_id
    try:
        pid = sbx.commands.run("sleep 3600", background=True).pid
        raw = httpx.get(f"{API_URL}/sandboxes/{sid}", headers=HEADERS).json()
        assert raw["lifecycle"] == {"autoResume": True, "onTimeout": "pause"}
        for _ in range(200):
            if Sandbox.get_info(sid).state == SandboxState.PAUSED:
                break
            time.sleep(0.1)
        assert Sandbox.get_info(sid).state == SandboxState.PAUSED
        # Any request wakes it, `/health` included (that is what is_running() asks).
        assert sbx.is_running()
        assert Sandbox.get_info(sid).state == SandboxState.RUNNING
        assert sbx.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
        # set_timeout(0): paused at once.
        sbx.set_timeout(0)
        for _ in range(100):
            if Sandbox.get_info(sid).state == SandboxState.PAUSED:
                break
            time.sleep(0.1)
        assert Sandbox.get_info(sid).state == SandboxState.PAUSED
        sbx.connect()
        assert sbx.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
    finally:
        sbx.kill()


def test_auto_pause_to_files_wakes_only_through_connect():
    sbx = Sandbox.create(timeout=3, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    sid = sbx.sandbox_id
    try:
        sbx.files.write("/home/user/kept", "yes")
        for _ in range(300):
            if saved_state(sid):
                break
            time.sleep(0.1)
        assert Sandbox.get_info(sid).state == SandboxState.PAUSED
        assert not sbx.is_running(), "traffic must not wake a sandbox paused to its files"
        sbx.connect()
        assert sbx.files.read("/home/user/kept") == "yes"
    finally:
        sbx.kill()


def test_lifecycle_refusals_of_the_server():
    # The SDK refuses these before sending; the server must too, for other clients.
    for body in ({"autoPauseMemory": False}, {"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}}):
        r = httpx.post(f"{API_URL}/sandboxes", headers=HEADERS, json={"templateID": "base", **body})
        assert r.status_code == 400, (body, r.status_code, r.text)


def test_unknown_and_killed_sandboxes():
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("inotasandbox0000000000")
    r = httpx.post(f"{API_URL}/sandboxes/inotasandbox0000000000/pause", headers=HEADERS)
    assert r.status_code == 404
    sbx = Sandbox.create(timeout=60)
    sbx.kill()
    with pytest.raises(SandboxNotFoundException):
        sbx.fork()
    with pytest.raises(SandboxNotFoundException):
        sbx.pause()


def test_snapshots():
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.commands.run("mkdir -p /home/user/tree/a/b && echo leaf > /home/user/tree/a/b/c && echo state > /home/user/s")
        snap = sbx.create_snapshot()
        assert snap.snapshot_id and snap.names == []
        # The source goes on with its id.
        assert sbx.is_running() and sbx.files.read("/home/user/s").strip() == "state"
        assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        assert snap.snapshot_id in [s.snapshot_id for s in sbx.list_snapshots().next_items()]
        one, two = Sandbox.create(snap.snapshot_id, timeout=60), Sandbox.create(snap.snapshot_id, timeout=60)
        try:
            assert one.files.read("/home/user/tree/a/b/c").strip() == "leaf"
            one.files.write("/home/user/s", "changed in one")
            assert two.files.read("/home/user/s").strip() == "state", "sandboxes of one snapshot must not share writes"
            assert sbx.files.read("/home/user/s").strip() == "state"
            # Deleting the snapshot does not take the files of sandboxes started from it.
            assert Sandbox.delete_snapshot(snap.snapshot_id) is True
            assert Sandbox.delete_snapshot(snap.snapshot_id) is False
            assert two.files.read("/home/user/tree/a/b/c").strip() == "leaf"
        finally:
            one.kill()
            two.kill()
        name = f"snap-test-{sbx.sandbox_id[-6:]}"
        named = Sandbox.create_snapshot(sbx.sandbox_id, name=name)
        try:
            assert name in named.names
            assert [s.snapshot_id for s in Sandbox.list_snapshots(name=name).next_items()] == [named.snapshot_id]
            assert Sandbox.list_snapshots(name=name + "-does-not-exist").next_items() == []
            from_name = Sandbox.create(name, timeout=60)
            assert from_name.files.read("/home/user/s").strip() == "state"
            from_name.kill()
        finally:
            assert Sandbox.delete_snapshot(named.snapshot_id)
        # A paused sandbox cannot be snapshotted.
        assert sbx.pause()
        r = httpx.post(f"{API_URL}/sandboxes/{sbx.sandbox_id}/snapshots", headers=HEADERS, json={})
        assert r.status_code == 409, r.text
    finally:
        sbx.kill()
    assert not glob.glob(f"{STATE_DIR}/images/snap-s*"), "deleted snapshots must leave no image"


def test_fork():
    sbx = Sandbox.create(timeout=120, metadata={"suite": "cordon-state", "role": "source"})
    try:
        sbx.files.write("/home/user/state", "state before fork")
        src_pid = sbx.commands.run("sleep 3600", background=True).pid
        end_before = Sandbox.get_info(sbx.sandbox_id).end_at
        (fork,) = sbx.fork(timeout=60)
        try:
            assert not isinstance(fork, Exception), fork
            assert fork.sandbox_id != sbx.sandbox_id
            assert sbx.is_running() and fork.is_running()
            assert fork.files.read("/home/user/state") == "state before fork"
            fork.files.write("/home/user/state", "written in the fork")
            assert sbx.files.read("/home/user/state") == "state before fork"
            # The source keeps its processes and deadline; the fork its own identity.
            assert sbx.commands.run(f"kill -0 {src_pid} && echo alive").stdout.strip() == "alive"
            assert Sandbox.get_info(sbx.sandbox_id).end_at == end_before
            assert Sandbox.get_info(fork.sandbox_id).metadata == {"suite": "cordon-state", "role": "source"}
            assert fork.commands.run("hostname").stdout.strip() == fork.sandbox_id
            ids = sbx.fork(count=2, timeout=60)
            try:
                assert all(not isinstance(f, Exception) for f in ids), ids
                assert len({f.sandbox_id for f in ids} | {sbx.sandbox_id}) == 3
                ids[0].files.write("/home/user/state", "zero")
                assert ids[1].files.read("/home/user/state") == "state before fork"
            finally:
                for f in ids:
                    if not isinstance(f, Exception):
                        f.kill()
            (cls_fork,) = Sandbox.fork(sbx.sandbox_id, timeout=60)
            cls_fork.kill()
        finally:
            fork.kill()
        assert sbx.pause()
        with pytest.raises(SandboxException):
            sbx.fork()
    finally:
        sbx.kill()
    assert not glob.glob(f"{STATE_DIR}/images/own-*"), "forks must leave no image once killed"


@needs_runsc
def runsc_processes(sid):
    """Host pids of runsc processes that name sandbox `sid` (its sentry, gofer, runsc itself)."""
    out = []
    for p in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            cmd = open(p, "rb").read().split(b"\0")
        except OSError:
            continue
        if cmd and b"runsc" in cmd[0] and any(sid.encode() in a for a in cmd):
            out.append(int(p.split("/")[2]))
    return out


def test_gvisor_pause_resume_and_fork():
    r = httpx.post(f"{API_URL}/sandboxes", headers=HEADERS, json={"templateID": "base", "tier": "gvisor", "timeout": 120}, timeout=60)
    assert r.status_code == 201, r.text
    sbx = Sandbox.connect(r.json()["sandboxID"])
    sid = sbx.sandbox_id
    try:
        pid = sbx.commands.run("sleep 3600", background=True).pid
        sbx.files.write("/tmp/index.html", "served from /tmp")
        sbx.commands.run("cd /tmp && python3 -m http.server 8000", background=True)
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"}
        wait_http(BASE_URL + "/index.html", headers)
        # 64 MiB held by a process: what the running sandbox costs the host, and what must be
        # back after the resume.
        hold_64mib(sbx, "/tmp/held")
        sbx.commands.run("sleep 3; echo done > /home/user/job", background=True)
        assert host_memory_bytes(sid) >= 64 << 20
        assert runsc_processes(sid), "a running gvisor sandbox is runsc processes on the host"

        # With memory, to disk: runsc writes the sandbox's kernel, every runsc process exits
        # and its memory is freed; the state is readable by the host only.
        assert sbx.pause()
        assert not sbx.is_running()
        assert httpx.get(f"{API_URL}/sandboxes/{sid}", headers=HEADERS).json()["pauseMode"] == "full"
        assert runsc_processes(sid) == [], "a paused gvisor sandbox must not keep runsc running"
        assert glob.glob(f"/sys/fs/cgroup/*/cordon/{sid}") + glob.glob(f"/sys/fs/cgroup/cordon/{sid}") == []
        mem = f"{STATE_DIR}/paused/{sid}.mem"
        assert os.stat(mem).st_mode & 0o077 == 0
        assert sum(os.path.getsize(f) for f in glob.glob(f"{mem}/image/*")) > 0
        assert httpx.get(BASE_URL + "/index.html", headers=headers).status_code == 502

        sbx.connect()
        assert sbx.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
        assert wait_http(BASE_URL + "/index.html", headers).text == "served from /tmp", "a server started before the pause answers after it"
        for _ in range(300):
            if sbx.files.exists("/home/user/job"):
                break
            time.sleep(0.1)
        assert sbx.files.read("/home/user/job").strip() == "done", "a background job must finish after the resume"
        assert host_memory_bytes(sid) >= 64 << 20, "the held memory is back"
        assert glob.glob(mem) == [], "the saved state goes with the resume"
        assert_deleted_soon(f"{STATE_DIR}/paused/.gone-{sid}-*")

        # To files: the writable layer through runsc's mount namespace. (gVisor's statx of this
        # release fails for GNU stat: Python reads the owners and modes.)
        sbx.files.write("/home/user/kept", "on gvisor")
        sbx.commands.run("echo r > /opt/r && chmod 600 /opt/r && rm -f /etc/motd", user="root")
        probe = "python3 -c \"import os; [print(p, oct(os.stat(p).st_mode), os.stat(p).st_uid) for p in ('/home/user/kept', '/opt/r')]\""
        before = sbx.commands.run(probe).stdout
        assert sbx.pause(mode="filesystem")
        assert httpx.get(f"{API_URL}/sandboxes/{sbx.sandbox_id}", headers=HEADERS).json()["pauseMode"] == "filesystem"
        sbx.connect()
        assert sbx.files.read("/home/user/kept") == "on gvisor"
        assert sbx.commands.run(probe).stdout == before
        assert not sbx.files.exists("/etc/motd")
        # A fork copies the processes too: the source is paused to disk, each fork restored
        # from that save under its own name, the source resumed from it.
        sleeper = sbx.commands.run("sleep 3600", background=True).pid
        end_before = Sandbox.get_info(sid).end_at
        r = httpx.post(f"{API_URL}/sandboxes/{sid}/fork", headers=HEADERS, json={"count": 2, "timeout": 60}, timeout=300)
        assert r.status_code == 201, r.text
        entries = r.json()
        assert all("sandbox" in f and f["sandbox"]["forkMode"] == "memory" for f in entries), entries
        forks = [Sandbox.connect(f["sandbox"]["sandboxID"]) for f in entries]
        try:
            for fork in forks:
                assert fork.sandbox_id != sid
                assert fork.files.read("/home/user/kept") == "on gvisor"
                assert fork.commands.run(f"kill -0 {sleeper} && echo alive").stdout.strip() == "alive", "a fork has the source's processes"
                assert fork.commands.run("hostname").stdout.strip() == fork.sandbox_id
                assert fork.commands.run("uname -r").stdout == sbx.commands.run("uname -r").stdout, "a fork of a gvisor sandbox is a gvisor sandbox"
            forks[0].files.write("/home/user/kept", "in fork 0")
            assert forks[1].files.read("/home/user/kept") == "on gvisor"
            # The source is back, the same sandbox: its processes, name, files and deadline.
            assert sbx.commands.run(f"kill -0 {sleeper} && echo alive").stdout.strip() == "alive"
            assert sbx.commands.run("hostname").stdout.strip() == sid
            assert sbx.files.read("/home/user/kept") == "on gvisor"
            assert Sandbox.get_info(sid).end_at == end_before
            assert glob.glob(f"{STATE_DIR}/paused/{sid}.mem") == [], "the fork's save goes once the source is back"
        finally:
            for fork in forks:
                fork.kill()
    finally:
        sbx.kill()
    assert saved_state(sbx.sandbox_id) == []
    # The source ran on an image of its own (its files' pause): the pause with memory kept it for
    # the resume, each fork ran on a copy, and every one went with its sandbox.
    assert not glob.glob(f"{STATE_DIR}/images/own-*") and not glob.glob(f"{STATE_DIR}/images/paused-{sid}-*")


def test_a_gvisor_sandbox_with_a_network_policy_pauses_in_place():
    """runsc cannot save host sockets: such a sandbox is frozen where it is, still paused with
    its memory, using no CPU, and thawed by the resume."""
    r = httpx.post(f"{API_URL}/sandboxes", headers=HEADERS, json={"templateID": "base", "tier": "gvisor", "timeout": 120, "network": {"allowOut": ["198.51.100.0/25"]}}, timeout=60)
    assert r.status_code == 201, r.text
    sbx = Sandbox.connect(r.json()["sandboxID"])
    sid = sbx.sandbox_id
    try:
        pid = sbx.commands.run("sleep 3600", background=True).pid
        running = runsc_processes(sid)
        assert sbx.pause()
        assert httpx.get(f"{API_URL}/sandboxes/{sid}", headers=HEADERS).json()["pauseMode"] == "full"
        assert runsc_processes(sid) == running, "frozen in place: the same runsc processes"
        assert not glob.glob(f"{STATE_DIR}/paused/{sid}.mem")
        before = host_cpu_usec(sid)
        time.sleep(1.0)
        assert host_cpu_usec(sid) == before
        sbx.connect()
        assert sbx.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
    finally:
        sbx.kill()


ASYNCIO_SERVER = """
import asyncio
async def answer(reader, writer):
    await reader.read(1024)
    writer.write(b"HTTP/1.0 200 OK\\r\\ncontent-length: 7\\r\\n\\r\\nasyncio")
    await writer.drain()
    writer.close()
async def main():
    server = await asyncio.start_server(answer, "127.0.0.1", 8001)
    await server.serve_forever()
asyncio.run(main())
"""


@needs_runsc
def test_a_gvisor_sandbox_whose_server_runsc_cannot_save_pauses_in_place():
    """This runsc ends a sandbox whose checkpoint meets a TCP socket watched by epoll (asyncio,
    node, most servers). Such a sandbox must not be lost to a pause: the agent says so first,
    and it is frozen in place; its server answers after the resume."""
    r = httpx.post(f"{API_URL}/sandboxes", headers=HEADERS, json={"templateID": "base", "tier": "gvisor", "timeout": 120}, timeout=60)
    assert r.status_code == 201, r.text
    sbx = Sandbox.connect(r.json()["sandboxID"])
    sid = sbx.sandbox_id
    try:
        sbx.files.write("/tmp/server.py", ASYNCIO_SERVER)
        sbx.commands.run("python3 /tmp/server.py", background=True)
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8001"}
        assert wait_http(BASE_URL + "/", headers).text == "asyncio"
        running = runsc_processes(sid)
        assert sbx.pause()
        assert httpx.get(f"{API_URL}/sandboxes/{sid}", headers=HEADERS).json()["pauseMode"] == "full"
        assert runsc_processes(sid) == running, "frozen in place: the same runsc processes"
        assert not glob.glob(f"{STATE_DIR}/paused/{sid}.mem")
        sbx.connect()
        assert wait_http(BASE_URL + "/", headers).text == "asyncio", "the server answers after the resume"
    finally:
        sbx.kill()


def test_a_filesystem_paused_sandbox_survives_a_restart():
    srv = Serve()
    srv.start()
    try:
        sbx = Sandbox.create(timeout=120, **srv.sdk())
        sid = sbx.sandbox_id
        sbx.files.write("/home/user/across", "the restart")
        assert sbx.pause(mode="filesystem")
        srv.stop()
        srv.start()
        listed = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]), **srv.sdk()).next_items()]
        assert sid in listed
        again = Sandbox.connect(sid, **srv.sdk())
        assert again.files.read("/home/user/across") == "the restart"
        # The same access token as before the restart still works.
        assert sbx.files.read("/home/user/across") == "the restart"
        assert again.pause(mode="filesystem")
        srv.stop(signal.SIGKILL)
        srv.start()
        assert Sandbox.kill(sid, **srv.sdk()) is True
        assert saved_state(sid) == []
    finally:
        srv.stop()


def test_a_gvisor_sandbox_paused_with_memory_survives_a_restart():
    srv = Serve()
    srv.start()
    try:
        r = srv.api("POST", "/sandboxes", json={"templateID": "base", "tier": "gvisor", "timeout": 120})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        sbx = Sandbox.connect(sid, **srv.sdk())
        pid = sbx.commands.run("sleep 3600", background=True).pid
        sbx.files.write("/tmp/across", "the restart")
        assert sbx.pause()
        srv.stop(signal.SIGKILL)
        srv.start()
        raw = srv.api("GET", f"/sandboxes/{sid}").json()
        assert (raw["state"], raw["pauseMode"]) == ("paused", "full"), raw
        again = Sandbox.connect(sid, **srv.sdk())
        assert again.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
        assert again.files.read("/tmp/across") == "the restart"
        # SIGKILL while the pause is under way: paused and resumable, or gone with nothing of it
        # left (its runsc reaped by the next start); never listed but broken.
        _kill_mid(srv, lambda: srv.api("POST", f"/sandboxes/{sid}/pause"), 0.05)
        srv.start()
        r = srv.api("GET", f"/sandboxes/{sid}")
        if r.status_code == 200:
            assert r.json()["state"] == "paused", r.text
            assert Sandbox.connect(sid, **srv.sdk()).commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
            assert Sandbox.connect(sid, **srv.sdk()).pause()
            srv.stop()
            srv.start()
        else:
            assert r.status_code == 404, r.text
        Sandbox.kill(sid, **srv.sdk())
        assert saved_state(sid) + glob.glob(f"{STATE_DIR}/paused/{sid}.mem") == []
        assert runsc_processes(sid) == []
    finally:
        srv.stop()


def _kill_mid(srv, request, delay):
    """Sends `request` to the second server and SIGKILLs it `delay` seconds later."""
    t = threading.Thread(target=lambda: _ignore(request), daemon=True)
    t.start()
    time.sleep(delay)
    srv.stop(signal.SIGKILL)
    t.join(timeout=30)


def _ignore(f):
    try:
        f()
    except Exception:
        pass


def _images():
    return sorted(os.listdir(f"{STATE_DIR}/images"))


def test_a_server_killed_during_a_pause_or_a_fork_leaves_nothing_broken():
    srv = Serve()
    srv.start()
    try:
        images = _images()
        sbx = Sandbox.create(timeout=120, **srv.sdk())
        sid = sbx.sandbox_id
        # Enough files that the pause is still writing them when the server dies.
        sbx.commands.run("head -c 300M /dev/urandom > /home/user/blob && sync")
        _kill_mid(srv, lambda: srv.api("POST", f"/sandboxes/{sid}/pause", json={"memory": False}), 0.3)
        srv.start()
        r = srv.api("GET", f"/sandboxes/{sid}")
        # Paused (the pause finished: resumable with its files), or running (it was cut short:
        # the sandbox, which outlives the server, runs on as after a failed pause, adopted by
        # the next one); never listed but broken.
        assert r.status_code == 200, r.text
        assert r.json()["state"] in ("paused", "running"), r.text
        again = Sandbox.connect(sid, **srv.sdk())
        assert again.commands.run("stat -c %s /home/user/blob").stdout.strip() == str(300 << 20)
        again.kill()
        assert saved_state(sid) == []
        assert _images() == images, "a pause cut short must leave no image behind"

        before = {s.sandbox_id for s in Sandbox.list(**srv.sdk()).next_items()}
        src = Sandbox.create(timeout=120, **srv.sdk())
        src.commands.run("head -c 200M /dev/urandom > /home/user/blob && sync")
        _kill_mid(srv, lambda: srv.api("POST", f"/sandboxes/{src.sandbox_id}/fork", json={"count": 3}), 0.3)
        srv.start()
        # The source runs on (adopted, thawed if the fork had frozen it), its files whole; a
        # fork listed before the server died runs too. Killed, they leave no image and no mount.
        assert srv.api("GET", f"/sandboxes/{src.sandbox_id}").json()["state"] == "running"
        assert Sandbox.connect(src.sandbox_id, **srv.sdk()).commands.run("stat -c %s /home/user/blob").stdout.strip() == str(200 << 20)
        for s in Sandbox.list(**srv.sdk()).next_items():
            if s.sandbox_id not in before:
                Sandbox.kill(s.sandbox_id, **srv.sdk())
        assert _images() == images, "a fork cut short must leave no image behind"
        assert src.sandbox_id not in _read("/proc/mounts"), "a killed sandbox's kept writable layer must be unmounted"
    finally:
        srv.stop()
