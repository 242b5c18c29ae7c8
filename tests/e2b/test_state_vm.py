"""The vm tier keeps its state with its memory, through the real SDK: a pause writes the guest's
memory and devices to disk and the VMM exits (its RAM and cgroup gone from the host), a resume
restores the same guest (same processes and PIDs, listeners, boot); forks and snapshots copy the
running guest, each copy with its own hostname and random state. Host-side checks read the
sandbox's cgroups and the server's state dir, where a pause that kept the VM running, or left
its saved memory behind, would show.

vm sandboxes are created with `tier: "vm"` in the create body (a cordon extension the SDK does
not send), then the SDK connects as to any sandbox."""

import glob
import os
import signal
import time

import httpx
import pytest
from e2b import Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import SandboxNotFoundException

from conftest import API_KEY, API_URL, BASE_URL, Serve, needs_qemu
from test_state import STATE_DIR, _kill_mid, assert_deleted_soon, hold_64mib, host_memory_bytes, saved_state, wait_http

pytestmark = needs_qemu

HEADERS = {"X-API-KEY": API_KEY}


def create_vm(api=API_URL, **body):
    r = httpx.post(f"{api}/sandboxes", headers=HEADERS, json={"templateID": "base", "tier": "vm", "timeout": 300, **body}, timeout=300)
    assert r.status_code == 201, r.text
    return r.json()["sandboxID"]


def kept(sid):
    """Everything the server keeps of `sid` on disk, its saved memory included."""
    return saved_state(sid) + glob.glob(f"{STATE_DIR}/paused/{sid}.mem") + glob.glob(f"{STATE_DIR}/paused/{sid}.disk")


def cgroups(sid):
    """The sandbox's cgroup directories on the host (v1 controllers, v2 or hybrid)."""
    return glob.glob(f"/sys/fs/cgroup/*/cordon/{sid}") + glob.glob(f"/sys/fs/cgroup/cordon/{sid}")


def alive(sbx, pid):
    return sbx.commands.run(f"kill -0 {pid} && echo alive || echo gone", timeout=60).stdout.strip()


def test_vm_memory_pause_frees_the_vmm_and_resumes_the_same_guest():
    sid = create_vm()
    sbx = Sandbox.connect(sid)
    try:
        sleeper = sbx.commands.run("sleep 3600", background=True)
        sbx.files.write("/home/user/www/index.html", "before the pause")
        sbx.commands.run("cd /home/user/www && python3 -m http.server 8000", background=True)
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"}
        wait_http(BASE_URL + "/index.html", headers, tries=600)
        # 64 MiB held in a process's memory: kept across the pause, and the measure of what a
        # running VMM holds on the host.
        hold_64mib(sbx, "/home/user/held")
        sbx.commands.run("sleep 3; echo done > /home/user/job", background=True)
        boot = sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
        assert cgroups(sid), "a running vm sandbox has its cgroup on the host"
        assert host_memory_bytes(sid) >= 64 << 20

        assert sbx.pause() is True
        assert sbx.pause() is False, "a second pause must say it was already paused"
        assert not sbx.is_running()
        raw = httpx.get(f"{API_URL}/sandboxes/{sid}", headers=HEADERS).json()
        assert raw["state"] == "paused" and raw["pauseMode"] == "full", raw
        assert sid in [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()]
        # The VMM is gone, its memory with it: nothing of the sandbox is left in the host's
        # cgroups, and its memory is a file only the host reads.
        assert cgroups(sid) == [], "a paused vm sandbox must not keep its VMM"
        state = f"{STATE_DIR}/paused/{sid}.mem/state"
        assert os.stat(state).st_size > 0
        assert os.stat(state).st_mode & 0o077 == 0 and os.stat(os.path.dirname(state)).st_mode & 0o077 == 0
        assert httpx.get(BASE_URL + "/index.html", headers=headers).status_code == 502
        with pytest.raises(SandboxNotFoundException):
            Sandbox.set_timeout(sid, 60)

        sbx.connect()
        assert sbx.is_running()
        assert alive(sbx, sleeper.pid) == "alive"
        assert sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout == boot
        assert sbx.commands.run("hostname").stdout.strip() == sid
        assert wait_http(BASE_URL + "/index.html", headers, tries=600).text == "before the pause"
        for _ in range(300):
            if sbx.files.exists("/home/user/job"):
                break
            time.sleep(0.1)
        assert sbx.files.read("/home/user/job").strip() == "done", "a background job must finish after the resume"
        # Its saved memory went with the resume: out of the way at once, deleted after the answer.
        assert glob.glob(f"{STATE_DIR}/paused/{sid}.mem") == []
        assert_deleted_soon(f"{STATE_DIR}/paused/.gone-{sid}-*")
        assert sbx.pause() is True
    finally:
        sbx.kill()
    assert kept(sid) == [], "a killed paused sandbox must leave nothing on disk"
    assert cgroups(sid) == []


def test_vm_filesystem_pause_keeps_the_disk_and_boots_afresh():
    sid = create_vm()
    sbx = Sandbox.connect(sid)
    try:
        pid = sbx.commands.run("sleep 3600", background=True).pid
        sbx.files.write("/home/user/kept", "on the vm")
        sbx.commands.run("echo r > /opt/r && chmod 600 /opt/r && rm -f /etc/motd", user="root")
        probe = "python3 -c \"import os; [print(p, oct(os.stat(p).st_mode), os.stat(p).st_uid) for p in ('/home/user/kept', '/opt/r')]\""
        before = sbx.commands.run(probe).stdout
        boot = sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
        assert sbx.pause(mode="filesystem") is True
        raw = httpx.get(f"{API_URL}/sandboxes/{sid}", headers=HEADERS).json()
        assert (raw["state"], raw["pauseMode"]) == ("paused", "filesystem"), raw
        # The VMM is gone; the guest's disk is kept whole, readable by the host only.
        assert cgroups(sid) == []
        disk = f"{STATE_DIR}/paused/{sid}.disk"
        assert os.stat(disk).st_mode & 0o077 == 0
        assert glob.glob(f"{STATE_DIR}/paused/{sid}.mem") == []
        # Only a connect wakes it.
        assert not sbx.is_running()
        sbx.connect()
        assert sbx.commands.run(probe).stdout == before, "files, owners and modes survive"
        assert sbx.files.read("/home/user/kept") == "on the vm"
        assert not sbx.files.exists("/etc/motd")
        assert sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout != boot, "a files-only resume is a fresh boot"
        assert alive(sbx, pid) == "gone"
        assert glob.glob(disk) == [], "the kept disk goes with the resume"
        assert sbx.pause(mode="filesystem") is True
    finally:
        sbx.kill()
    assert kept(sid) == []
    assert cgroups(sid) == []


def test_vm_auto_pause_at_timeout_and_wake_on_traffic():
    sid = create_vm(timeout=5, autoPause=True, autoResume={"enabled": True})
    sbx = Sandbox.connect(sid)
    try:
        pid = sbx.commands.run("sleep 3600", background=True).pid
        # Listed as paused from the pause's start; its VMM is gone once the pause is written.
        for _ in range(600):
            if Sandbox.get_info(sid).state == SandboxState.PAUSED and not cgroups(sid):
                break
            time.sleep(0.1)
        assert Sandbox.get_info(sid).state == SandboxState.PAUSED
        assert cgroups(sid) == []
        # Any request it would admit wakes it from disk, `/health` (is_running()) included.
        assert sbx.is_running()
        assert Sandbox.get_info(sid).state == SandboxState.RUNNING
        assert alive(sbx, pid) == "alive"
        # A request it would not admit does not wake it.
        sbx.pause()
        r = httpx.get(BASE_URL + "/files?path=/etc/hostname", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": "not-its-token"})
        assert r.status_code == 502, r.text
        assert Sandbox.get_info(sid).state == SandboxState.PAUSED
    finally:
        sbx.kill()
    assert kept(sid) == []


def test_vm_fork_copies_the_running_guest():
    sid = create_vm()
    src = Sandbox.connect(sid)
    forks = []
    try:
        pid = src.commands.run("sleep 3600", background=True).pid
        src.files.write("/home/user/kept", "from the source")
        deadline = Sandbox.get_info(sid).end_at
        forks = src.fork(count=2, timeout=120)
        assert len(forks) == 2 and not any(isinstance(f, Exception) for f in forks), forks
        raw = httpx.post(f"{API_URL}/sandboxes/{sid}/fork", headers=HEADERS, json={"count": 1, "timeout": 60}, timeout=300).json()
        (extra,) = raw
        assert extra["sandbox"]["forkMode"] == "memory", raw
        forks.append(Sandbox.connect(extra["sandbox"]["sandboxID"]))
        seen = set()
        for f in forks:
            assert f.sandbox_id != sid
            assert f.commands.run("hostname").stdout.strip() == f.sandbox_id
            assert alive(f, pid) == "alive", "a fork of a vm sandbox keeps the source's processes"
            assert f.files.read("/home/user/kept") == "from the source"
            f.files.write("/home/user/kept", f"from {f.sandbox_id}")
            seen.add(f.commands.run("head -c 16 /dev/urandom | od -An -tx1").stdout)
        assert len(seen) == len(forks), "each fork must have its own random state"
        # The source goes on as it was, untouched by its forks' writes.
        assert src.files.read("/home/user/kept") == "from the source"
        assert alive(src, pid) == "alive"
        assert Sandbox.get_info(sid).end_at == deadline
        assert src.pause() is True
        r = httpx.post(f"{API_URL}/sandboxes/{sid}/fork", headers=HEADERS, json={"count": 1}, timeout=60)
        assert r.status_code == 409, r.text
    finally:
        for f in forks:
            f.kill()
        src.kill()
    assert httpx.post(f"{API_URL}/sandboxes/{sid}/fork", headers=HEADERS, json={"count": 1}).status_code == 404
    # No fork's saved state is left behind.
    assert glob.glob(f"{STATE_DIR}/paused/.fork-{sid}-*") == []


def test_vm_snapshot_keeps_the_running_guest():
    sid = create_vm(memoryMB=384)
    src = Sandbox.connect(sid)
    kept_before = sorted(os.listdir(f"{STATE_DIR}/snapshots"))
    try:
        pid = src.commands.run("sleep 3600", background=True).pid
        src.files.write("/home/user/kept", "at the snapshot")
        snap = src.create_snapshot(name="cordon-vm-state")
        src.files.write("/home/user/kept", "after it")
        r = httpx.post(f"{API_URL}/sandboxes", headers=HEADERS, json={"templateID": snap.snapshot_id, "timeout": 120}, timeout=300)
        assert r.status_code == 201, r.text
        child = Sandbox.connect(r.json()["sandboxID"])
        try:
            assert child.commands.run("hostname").stdout.strip() == child.sandbox_id
            assert alive(child, pid) == "alive"
            assert child.files.read("/home/user/kept") == "at the snapshot"
            assert httpx.get(f"{API_URL}/sandboxes/{child.sandbox_id}", headers=HEADERS).json()["memoryMB"] == 384
        finally:
            child.kill()
        # Its memory belongs to a vm sandbox: no other tier can start it.
        r = httpx.post(f"{API_URL}/sandboxes", headers=HEADERS, json={"templateID": snap.snapshot_id, "tier": "ns"}, timeout=60)
        assert r.status_code == 400 and "vm" in r.json()["message"], r.text
        assert alive(src, pid) == "alive"
    finally:
        src.kill()
        assert httpx.delete(f"{API_URL}/templates/cordon-vm-state", headers=HEADERS).status_code == 204
    assert httpx.delete(f"{API_URL}/templates/cordon-vm-state", headers=HEADERS).status_code == 404
    assert sorted(os.listdir(f"{STATE_DIR}/snapshots")) == kept_before, "a deleted snapshot's memory must be gone"


def test_a_vm_paused_with_memory_survives_a_restart_and_a_kill_mid_pause():
    srv = Serve()
    srv.start()
    try:
        sid = create_vm(api=srv.url)
        sbx = Sandbox.connect(sid, **srv.sdk())
        pid = sbx.commands.run("sleep 3600", background=True).pid
        assert sbx.pause() is True
        srv.stop()
        srv.start()
        assert sid in [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]), **srv.sdk()).next_items()]
        again = Sandbox.connect(sid, **srv.sdk())
        assert alive(again, pid) == "alive", "a vm paused with its memory keeps its processes across a restart"

        # SIGKILL while the pause is under way: the sandbox is then paused and resumable,
        # running (cut short before its guest parked: the VM, which outlives its server, runs
        # on, adopted by the next one), or gone with nothing of it left; never listed but broken.
        _kill_mid(srv, lambda: srv.api("POST", f"/sandboxes/{sid}/pause"), 0.05)
        srv.start()
        r = srv.api("GET", f"/sandboxes/{sid}")
        if r.status_code == 200:
            assert r.json()["state"] in ("paused", "running"), r.text
            assert alive(Sandbox.connect(sid, **srv.sdk()), pid) == "alive"
        else:
            assert r.status_code == 404, r.text
            assert kept(sid) == []
        Sandbox.kill(sid, **srv.sdk())
        assert kept(sid) == []
        # The killed server's VM, if its pause was cut short, was reaped when the new one started.
        assert cgroups(sid) == []
        # Saved memory that no record names (a pause cut short) is gone after the restart.
        assert [p for p in glob.glob(f"{STATE_DIR}/paused/*.mem") if not os.path.exists(p[: -len(".mem")] + ".json")] == []
    finally:
        srv.stop()


def test_a_vm_keeps_its_network_across_a_pause_and_in_its_forks():
    """A networked VM's interface is part of its machine: after a memory pause and resume, and in
    each fork, the guest has it with the policy in force (a dial no rule opens is refused at once
    and lands in that sandbox's own trail); a fork gets a MAC of its own."""
    from test_network_api import assert_refused_at_once, blocked_to, dial

    sid = create_vm(network={"allowOut": ["198.51.100.0/25"]})
    src = Sandbox.connect(sid)
    forks = []
    mac_of = lambda s: s.commands.run("cat /sys/class/net/eth0/address", timeout=60).stdout.strip()
    try:
        mac = mac_of(src)
        assert src.pause() is True
        src = Sandbox.connect(sid)
        assert mac_of(src) == mac
        assert_refused_at_once(dial(src, "198.51.100.200"))
        assert blocked_to(sid, "198.51.100.200")
        forks = src.fork(count=1, timeout=120)
        assert len(forks) == 1 and not isinstance(forks[0], Exception), forks
        fork = forks[0]
        assert mac_of(fork) not in (mac, "")
        assert_refused_at_once(dial(fork, "198.51.100.201"))
        assert blocked_to(fork.sandbox_id, "198.51.100.201")
        assert not blocked_to(sid, "198.51.100.201"), "the fork's attempt is in the source's trail"
        net = httpx.get(f"{API_URL}/sandboxes/{fork.sandbox_id}", headers=HEADERS, timeout=30).json()["network"]
        assert net["allowOut"] == ["198.51.100.0/25"], net
    finally:
        for f in forks:
            if not isinstance(f, Exception):
                f.kill()
        src.kill()
