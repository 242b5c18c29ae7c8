"""Volumes in the vm tier: shared with the guest over virtio-fs by a daemon in the VM's
cgroups, so a VM and sandboxes of the other tiers use one volume at once, with the same owners.
Read-only holds against guest root (who can remount inside), device nodes never reach the
volume, and a pause keeps the mount where it can (files) and says why where it cannot
(memory: virtio-fs is not migratable)."""

import glob
import os
import subprocess

import httpx
import pytest
from e2b import Sandbox

from conftest import API_KEY, API_URL, needs_qemu
from test_volumes import STATE, owners, volume  # noqa: F401 (the fixture)

pytestmark = needs_qemu

HEADERS = {"X-API-KEY": API_KEY}


def create_vm(mounts, **body):
    r = httpx.post(f"{API_URL}/sandboxes", headers=HEADERS, json={"templateID": "base", "tier": "vm", "timeout": 300, "volumeMounts": mounts, **body}, timeout=300)
    assert r.status_code == 201, r.text
    return Sandbox.connect(r.json()["sandboxID"])


def virtiofsd_pids():
    """The daemons (each forks once more into a PID namespace of its own: not counted)."""
    pids = {}
    for p in glob.glob("/proc/[0-9]*/stat"):
        try:
            stat = open(p).read()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if comm == "virtiofsd":
            pids[int(p.split("/")[2])] = int(rest[1])
    return sorted(pid for pid, ppid in pids.items() if ppid not in pids)


def test_a_vm_and_an_ns_sandbox_share_a_volume(volume):
    volume.write_file("/from_api", "api", uid=1000, gid=1000, mode=0o600)
    before = virtiofsd_pids()
    vm = create_vm([{"name": volume.name, "path": "/mnt/data"}, {"name": volume.name, "path": "/mnt/ro"}])
    ns = Sandbox.create(timeout=120, volume_mounts={"/data": volume})
    try:
        assert len(virtiofsd_pids()) == len(before) + 2, "one daemon per share"
        assert owners(vm, "/mnt/data") == {"from_api": [1000, 1000, 0o600]}
        vm.commands.run("echo from vm > /mnt/data/from_vm", timeout=60)
        assert ns.commands.run("cat /data/from_vm").stdout == "from vm\n"
        ns.commands.run("echo from ns > /data/from_ns")
        # No cache in the guest: the other sandbox's file is there at once.
        assert vm.commands.run("cat /mnt/data/from_ns", timeout=60).stdout == "from ns\n"
        assert owners(ns, "/data")["from_vm"] == [1000, 1000, 0o644]
        # Guest root may make device nodes in its own disk, never on the volume.
        r = vm.commands.run("sudo mknod /mnt/data/mem c 1 1 2>&1; echo rc=$?", timeout=60)
        assert "rc=0" not in r.stdout, r.stdout
        assert not os.path.exists(os.path.join(STATE, "volumes", volume.volume_id, "mnt", "mem"))
        # A memory pause cannot carry the shares: refused with the reason, the VM goes on.
        r = httpx.post(f"{API_URL}/sandboxes/{vm.sandbox_id}/pause", headers=HEADERS, timeout=120)
        assert r.status_code == 409 and "virtio-fs" in r.text, r.text
        assert vm.commands.run("cat /mnt/data/from_api", timeout=60).stdout == "api"
    finally:
        vm.kill()
        ns.kill()
    # The daemons die with their VM.
    assert virtiofsd_pids() == before


def test_read_only_holds_against_guest_root_and_a_files_pause_keeps_the_mount(volume):
    volume.write_file("/keep", "kept")
    # cordon run's :ro, which the API has no field for: guest root remounts read-write inside
    # its own kernel, and the daemon's read-only view still refuses the write.
    out = subprocess.run(
        [os.environ.get("CORDON_BIN", "cordon"), "run", "--tier", "vm", "--volume", f"{volume.name}:/v:ro", "--",
         "sh", "-c", "sudo mount -o remount,rw /v; sudo sh -c 'echo x > /v/keep'; echo rc=$?; cat /v/keep"],
        capture_output=True, text=True, timeout=300,
    )
    assert "Read-only file system" in out.stderr and "rc=0" not in out.stdout and out.stdout.rstrip().endswith("kept"), out
    assert volume.read_file("/keep") == "kept"

    vm = create_vm([{"name": volume.name, "path": "/data"}])
    try:
        vm.commands.run("echo before > /data/f", timeout=60)
        assert vm.pause(mode="filesystem") is True
        # Paused, it holds the volume.
        assert httpx.delete(f"{API_URL}/volumes/{volume.volume_id}", headers=HEADERS).status_code == 409
        volume.write_file("/while_paused", "written meanwhile")
        vm = Sandbox.connect(vm.sandbox_id, timeout=300)
        assert vm.commands.run("cat /data/f /data/while_paused", timeout=60).stdout == "before\nwritten meanwhile"
    finally:
        vm.kill()
