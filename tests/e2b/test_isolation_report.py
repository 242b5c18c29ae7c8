"""The isolation report (`GET /sandboxes/{id}/isolation`, `cordon inspect ID [--verify]
[--expect FILE]`): sandboxes of each tier with different caps and policies, each field checked
against what the test configured, against the host's own /proc read here, and against what the
probe sees inside (`--verify`); an expectation the sandbox does not meet makes it fail. Only a
TEST-NET address appears in a rule; nothing is dialled."""

import json
import os
import subprocess
import time
import uuid

import httpx
import pytest
from e2b import Sandbox, Secret

from conftest import API_KEY, API_URL, DENIED_SYSCALL, needs_qemu, needs_runsc
from test_server import STATE

H = {"X-API-KEY": API_KEY}


def create(**body):
    r = httpx.post(f"{API_URL}/sandboxes", headers=H, json={"templateID": "base", "timeout": 300, **body}, timeout=300)
    assert r.status_code == 201, r.text
    return r.json()["sandboxID"]


def kill(sid):
    httpx.delete(f"{API_URL}/sandboxes/{sid}", headers=H, timeout=60)


def report(sid):
    r = httpx.get(f"{API_URL}/sandboxes/{sid}/isolation", headers=H, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def inspect(sid, *flags):
    env = dict(os.environ, E2B_API_URL=API_URL, E2B_API_KEY=API_KEY)
    return subprocess.run([os.environ["CORDON_BIN"], "inspect", sid, *flags], capture_output=True, text=True, timeout=600, env=env)


def status_field(text, key):
    return next(l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith(key + ":"))


def agent_pid(sid):
    with open(f"{STATE}/run/{sid}/record.json") as f:
        return json.load(f)["pid"]


def test_an_ns_sandbox_s_report_matches_its_configuration_the_host_s_proc_and_its_own_view(tmp_path):
    sid = create(memoryMB=300, cpuCount=2)
    try:
        v = report(sid)
        assert (v["schema"], v["sandboxID"], v["tier"]) == ("cordon.isolation/v1", sid, "ns")
        assert v["unknown"] == {}, v["unknown"]
        # Limits as the cgroups hold them: what the create asked for.
        cg = v["cgroup"]
        assert cg["memoryBytes"] == 300 << 20 and cg["swapBytes"] == 0, cg
        assert cg["cpuQuotaUs"] == 2 * cg["cpuPeriodUs"], cg
        assert cg["pids"] and cg["pids"] > 0, cg
        assert {"mnt", "pid", "net", "user", "uts", "ipc", "cgroup"} <= set(v["namespaces"]), v["namespaces"]
        # The uid range: sandbox root is an unprivileged host uid, 65536 of them.
        [[inside, outside, count]] = v["idMaps"]["uid"]
        assert (inside, count) == (0, 65536) and outside >= 65536, v["idMaps"]
        # PID 1's credentials are the host kernel's own account, read here independently.
        with open(f"/proc/{agent_pid(sid)}/status") as f:
            status = f.read()
        pid1 = v["capabilities"]["pid1"]
        assert pid1["capBnd"] == status_field(status, "CapBnd") and pid1["capEff"] == status_field(status, "CapEff"), pid1
        assert v["noNewPrivs"] == (status_field(status, "NoNewPrivs") == "1")
        assert v["seccomp"]["mode"] == "filter" and status_field(status, "Seccomp") == "2"
        assert len(v["seccomp"]["sha256"]) == 64 and v["seccomp"]["policy"].startswith("crates/jail/seccomp/sandbox.json")
        assert v["landlock"]["enforced"] in ("full", "partial", "none") and v["landlock"]["rules"], v["landlock"]
        assert any("tcp: not handled" in r for r in v["landlock"]["rules"]), v["landlock"]
        targets = {(m["target"], m["fstype"]) for m in v["mounts"]}
        assert ("/", "overlay") in targets and ("/proc", "proc") in targets, targets
        assert "/proc/kcore" in v["maskedProc"] and "/proc/sys/kernel/random/boot_id" in v["maskedProc"]
        assert v["network"]["enabled"] is False and v["network"]["allowOut"] == []
        assert v["usage"]["memoryBytes"] > 0 and v["usage"]["cpuUsec"] > 0, v["usage"]
        # The audit counters move with what the sandbox does: a denied call is counted.
        assert "records it" in v["seccomp"]["notified"], v["seccomp"]
        denied_before = v["audit"]["deniedSyscalls"]
        assert Sandbox.connect(sid).commands.run(DENIED_SYSCALL, timeout=60).stdout.strip() == "1"
        counted = denied_before
        for _ in range(50):
            counted = report(sid)["audit"]["deniedSyscalls"]
            if counted > denied_before:
                break
            time.sleep(0.1)
        assert counted > denied_before, (denied_before, counted)
        # The default user's capabilities, as a command of the sandbox sees them.
        own = Sandbox.connect(sid).commands.run("cat /proc/self/status", timeout=60).stdout
        user = v["capabilities"]["defaultUser"]
        assert (user["capBnd"], user["capEff"], user["capAmb"]) == (status_field(own, "CapBnd"), status_field(own, "CapEff"), status_field(own, "CapAmb"))

        # The CLI prints the same report, and --verify agrees with the probe inside.
        p = inspect(sid, "--verify")
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert out["cgroup"] == cg and out["verify"]["differences"] == [], out["verify"]
        checked = set(out["verify"]["checked"])
        assert {"idMaps.uid", "capabilities.defaultUser.capBnd", "seccomp.mode", "landlock.abi", "mounts (target and type)", "network.enabled (interfaces besides lo)"} <= checked, checked
        assert out["verify"]["probe"]["hostname"] == sid

        # An expectation the sandbox meets passes; an altered one fails, naming the field.
        good, bad = tmp_path / "good.json", tmp_path / "bad.json"
        good.write_text(json.dumps({"cgroup": {"memoryBytes": 300 << 20}, "network": {"enabled": False}}))
        bad.write_text(json.dumps({"cgroup": {"memoryBytes": 301 << 20}, "network": {"enabled": False}}))
        assert inspect(sid, "--verify", "--expect", str(good)).returncode == 0
        p = inspect(sid, "--verify", "--expect", str(bad))
        assert p.returncode == 1, p.stderr
        assert f"cgroup.memoryBytes: expected {301 << 20}, the report has {300 << 20}" in p.stderr, p.stderr
    finally:
        kill(sid)


def test_a_networked_sandbox_s_report_carries_its_policy_and_the_probe_sees_its_interface():
    sid = create(network={"allowOut": ["203.0.113.7"]})
    try:
        v = report(sid)
        assert v["network"]["enabled"] is True and v["network"]["allowOut"] == ["203.0.113.7/32"], v["network"]
        assert "net" in v["namespaces"]
        # A policy of addresses only, not ports: Landlock leaves TCP to the netns and forwarder.
        assert any("tcp: not handled" in r for r in v["landlock"]["rules"]), v["landlock"]
        p = inspect(sid, "--verify")
        assert p.returncode == 0, p.stderr
        assert "network.enabled (interfaces besides lo)" in json.loads(p.stdout)["verify"]["checked"]
    finally:
        kill(sid)


def test_bad_requests_for_a_report_fail_clearly():
    assert httpx.get(f"{API_URL}/sandboxes/inosuchsandbox00000000/isolation", headers=H).status_code == 404
    p = inspect("inosuchsandbox00000000")
    assert p.returncode == 1 and "not found" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    sid = create()
    try:
        assert httpx.post(f"{API_URL}/sandboxes/{sid}/pause", headers=H, json={}, timeout=60).status_code == 204
        r = httpx.get(f"{API_URL}/sandboxes/{sid}/isolation?verify=true", headers=H, timeout=60)
        assert r.status_code == 409 and "paused" in r.json()["message"], r.text
    finally:
        kill(sid)


@needs_runsc
def test_a_gvisor_sandbox_s_report_says_what_the_host_cannot_see_and_verifies_the_rest():
    sid = create(tier="gvisor", memoryMB=256)
    try:
        v = report(sid)
        assert v["tier"] == "gvisor" and v["runtime"]["version"].startswith("runsc version"), v["runtime"]
        assert v["runtime"]["platform"] in ("ptrace", "systrap", "kvm")
        # Fields only gVisor's kernel knows are null, each with a reason.
        assert v["capabilities"]["pid1"] is None and "gVisor" in v["unknown"]["capabilities.pid1"], v["unknown"]
        assert v["mounts"] is None and "mounts" in v["unknown"]
        # Its cgroups hold the sandbox's cap plus gVisor's own share.
        assert v["cgroup"]["memoryBytes"] > 256 << 20
        p = inspect(sid, "--verify")
        assert p.returncode == 0, p.stderr
        checked = json.loads(p.stdout)["verify"]["checked"]
        assert "capabilities.defaultUser.capBnd" in checked and "sandboxID (hostname)" in checked, checked
    finally:
        kill(sid)


@needs_runsc
def test_a_networked_gvisor_sandbox_s_report_names_the_hosts_whose_tls_is_terminated():
    """An injection rule makes the forwarder terminate TLS to its host: the report says which."""
    secret = f"iso-{uuid.uuid4().hex[:10]}"
    Secret.create(secret, f"sk-{uuid.uuid4().hex}")
    rules = {"api.e2b.test": [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets." + secret + "}"}}}]}
    try:
        sid = create(tier="gvisor", cpuCount=1, network={"allowOut": ["203.0.113.7"], "denyOut": ["198.51.100.0/24"], "rules": rules})
        try:
            v = report(sid)
            n = v["network"]
            assert (n["enabled"], n["allowOut"], n["denyOut"]) == (True, ["203.0.113.7/32"], ["198.51.100.0/24"]), n
            assert n["tlsTerminatedHosts"] == ["api.e2b.test"], n
            # Nothing was sent yet, so nothing was injected.
            assert v["audit"]["injectedHeaders"] == 0, v["audit"]
            assert v["cgroup"]["cpuQuotaUs"] and v["cgroup"]["cpuQuotaUs"] >= v["cgroup"]["cpuPeriodUs"], v["cgroup"]
            p = inspect(sid, "--verify")
            assert p.returncode == 0, p.stderr
            assert "network.enabled (interfaces besides lo)" in json.loads(p.stdout)["verify"]["checked"]
        finally:
            kill(sid)
        # Without rules, no TLS is terminated.
        sid = create(tier="gvisor", network={"allowOut": ["203.0.113.7"]})
        try:
            assert report(sid)["network"]["tlsTerminatedHosts"] == []
        finally:
            kill(sid)
    finally:
        Secret.destroy(secret)


@needs_qemu
def test_a_vm_sandbox_s_report_names_its_vmm_and_guest_kernel():
    sid = create(tier="vm", memoryMB=384)
    try:
        v = report(sid)
        assert v["tier"] == "vm" and v["runtime"]["accelerator"] in ("tcg", "kvm"), v["runtime"]
        # The VMM's group holds the guest's RAM and QEMU's own share on top.
        assert v["cgroup"]["memoryBytes"] > 384 << 20 and "cgroup" not in v["unknown"], v["cgroup"]
        assert v["usage"]["memoryBytes"] > 0, v["usage"]
        assert v["runtime"]["version"].startswith("QEMU") and "guest" in v["runtime"]["kernel"], v["runtime"]
        assert v["namespaces"] is None and "guest" in v["unknown"]["namespaces"]
        p = inspect(sid, "--verify")
        assert p.returncode == 0, p.stderr
        assert "sandboxID (hostname)" in json.loads(p.stdout)["verify"]["checked"]
    finally:
        kill(sid)


def test_cordon_run_report_prints_the_same_schema():
    p = subprocess.run([os.environ["CORDON_BIN"], "run", "--report", "--memory", "200M", "--", "true"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    v = json.loads(p.stderr.strip().splitlines()[-1])
    assert v["schema"] == "cordon.isolation/v1" and v["tier"] == "ns" and v["cgroup"]["memoryBytes"] == 200 << 20, v
