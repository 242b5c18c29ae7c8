"""Warm pools (`cordon serve --pool TEMPLATE[:TIER]=N`) through the real SDKs: a create that
matches takes a pooled sandbox and gives it its identity (env, metadata, limits written to its
cgroups, network policy), the pool refills, a pooled sandbox is used once and shares nothing with
the next user, and the host's `/init` cannot be called by a client. Servers of their own are
started here; `GET /pools` says what each pool holds and handed over. Only refused TEST-NET
addresses are dialled."""

import glob
import os
import time

import httpx
import pytest
from e2b import Sandbox

from conftest import API_KEY, Serve, needs_qemu, needs_runsc
from test_network_api import DIAL, assert_refused_at_once

H = {"X-API-KEY": API_KEY}


def pools(srv):
    r = srv.api("GET", "/pools")
    assert r.status_code == 200, r.text
    return {(p["templateID"], p["tier"]): p for p in r.json()["pools"]}


def wait_ready(srv, key, n, within=300):
    """Polls `GET /pools` until pool `key` holds `n` waiting sandboxes; returns its entry."""
    deadline = time.monotonic() + within
    while True:
        p = pools(srv)[key]
        if p["ready"] >= n:
            return p
        assert time.monotonic() < deadline, f"pool {key} never held {n}: {p}"
        time.sleep(0.2)


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def memory_limit(sid):
    """The memory cap written to the sandbox's cgroups on the host (v1, or the unified group)."""
    for path in [f"/sys/fs/cgroup/memory/cordon/{sid}/memory.limit_in_bytes", f"/sys/fs/cgroup/cordon/{sid}/memory.max", f"/sys/fs/cgroup/unified/cordon/{sid}/memory.max"]:
        v = _read(path)
        if v is not None:
            return int(v)
    raise AssertionError(f"no memory cap found for sandbox {sid}")


def cpu_quota(sid):
    """The CPU cap written to the sandbox's cgroups, as (quota, period) in microseconds."""
    for d in ("cpu,cpuacct", "cpu"):
        q, p = _read(f"/sys/fs/cgroup/{d}/cordon/{sid}/cpu.cfs_quota_us"), _read(f"/sys/fs/cgroup/{d}/cordon/{sid}/cpu.cfs_period_us")
        if q is not None and p is not None:
            return int(q), int(p)
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        v = _read(f"{root}/cordon/{sid}/cpu.max")
        if v is not None:
            q, p = v.split()
            return int(q), int(p)
    raise AssertionError(f"no cpu cap found for sandbox {sid}")


@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    log = open(tmp_path_factory.mktemp("pool") / "serve.log", "w")
    srv = Serve("--pool", "base=2", log=log).start()
    try:
        wait_ready(srv, ("base", "ns"), 2)
        yield srv
    finally:
        srv.stop()
        log.close()


def test_a_create_takes_a_pooled_sandbox_with_its_own_identity_and_the_pool_refills(pooled):
    before = pools(pooled)[("base", "ns")]
    sbx = Sandbox.create(envs={"POOL_ENV": "given at create", "PATH": "/opt/x:/usr/bin:/bin"}, metadata={"who": "first"}, timeout=60, **pooled.sdk())
    try:
        after = pools(pooled)[("base", "ns")]
        assert after["taken"] == before["taken"] + 1, (before, after)
        # The create's environment reaches every command as it does in a sandbox started for
        # its create (another disk size: no pool matches).
        probe = "echo $POOL_ENV; echo $PATH; hostname"
        out = sbx.commands.run(probe, timeout=30).stdout.splitlines()
        assert out[0] == "given at create" and out[2] == sbx.sandbox_id, out
        r = pooled.api("POST", "/sandboxes", json={"templateID": "base", "timeout": 60, "diskSizeMB": 700, "envVars": {"POOL_ENV": "given at create", "PATH": "/opt/x:/usr/bin:/bin"}})
        assert r.status_code == 201, r.text
        try:
            own = Sandbox.connect(r.json()["sandboxID"], **pooled.sdk())
            assert own.commands.run(probe, timeout=30).stdout.splitlines()[:2] == out[:2]
        finally:
            pooled.api("DELETE", f"/sandboxes/{r.json()['sandboxID']}")
        info = sbx.get_info()
        assert info.metadata == {"who": "first"}, info
        # The pool is refilled in the background.
        wait_ready(pooled, ("base", "ns"), 2, within=120)
    finally:
        sbx.kill()


def test_the_create_s_limits_are_written_to_the_pooled_sandbox_s_cgroups(pooled):
    wait_ready(pooled, ("base", "ns"), 1)
    before = pools(pooled)[("base", "ns")]["taken"]
    r = pooled.api("POST", "/sandboxes", json={"templateID": "base", "timeout": 60, "memoryMB": 300, "cpuCount": 2})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    try:
        assert pools(pooled)[("base", "ns")]["taken"] == before + 1
        assert memory_limit(sid) == 300 << 20
        quota, period = cpu_quota(sid)
        assert quota == 2 * period, (quota, period)
        sbx = Sandbox.connect(sid, **pooled.sdk())
        assert sbx.commands.run("true", timeout=30).exit_code == 0
    finally:
        pooled.api("DELETE", f"/sandboxes/{sid}")


def test_a_pooled_sandbox_is_used_once_and_shares_nothing_with_the_next_user(pooled):
    wait_ready(pooled, ("base", "ns"), 2)
    first = Sandbox.create(timeout=60, **pooled.sdk())
    second = Sandbox.create(timeout=60, **pooled.sdk())
    try:
        assert first.sandbox_id != second.sandbox_id
        first.files.write("/home/user/mark", "first's")
        first.commands.run("sleep 1000 >/dev/null 2>&1 &", timeout=30)
        # Siblings do not see each other's files or processes.
        assert not second.files.exists("/home/user/mark")
        assert "sleep 1000" not in second.commands.run("ps -eo args", timeout=30).stdout
    finally:
        first_id = first.sandbox_id
        first.kill()
        second.kill()
    # The first one is gone for good: its id is not found, and its cgroups are removed.
    assert pooled.api("GET", f"/sandboxes/{first_id}").status_code == 404
    wait_ready(pooled, ("base", "ns"), 2, within=120)
    third = Sandbox.create(timeout=60, **pooled.sdk())
    try:
        assert third.sandbox_id not in (first_id, second.sandbox_id)
        assert not third.files.exists("/home/user/mark")
        assert "sleep 1000" not in third.commands.run("ps -eo args", timeout=30).stdout
    finally:
        third.kill()
    deadline = time.monotonic() + 30
    while glob.glob(f"/sys/fs/cgroup/*/cordon/{first_id}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not glob.glob(f"/sys/fs/cgroup/*/cordon/{first_id}")


def test_creates_that_a_pool_cannot_serve_start_their_own(pooled):
    before = pools(pooled)[("base", "ns")]["taken"]
    # Another disk size: a writable layer's size is fixed when it is made.
    r = pooled.api("POST", "/sandboxes", json={"templateID": "base", "timeout": 60, "diskSizeMB": 700})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    # A network: the pool's sandboxes have none to open (the server's default is closed).
    sbx = Sandbox.create(timeout=60, allow_internet_access=True, network={"allow_out": ["203.0.113.7"]}, **pooled.sdk())
    try:
        assert pools(pooled)[("base", "ns")]["taken"] == before
        assert Sandbox.connect(sid, **pooled.sdk()).commands.run("true", timeout=30).exit_code == 0
        assert sbx.commands.run("true", timeout=30).exit_code == 0
    finally:
        pooled.api("DELETE", f"/sandboxes/{sid}")
        sbx.kill()


def test_a_client_cannot_call_the_host_s_init(pooled):
    sbx = Sandbox.create(timeout=60, **pooled.sdk())
    try:
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983", "X-Access-Token": sbx._envd_access_token or ""}
        r = httpx.post(pooled.url + "/init", headers=headers, json={"envVars": {"INJECTED": "yes"}}, timeout=30)
        assert r.status_code == 404, r.text
        assert sbx.commands.run("echo ${INJECTED:-absent}", timeout=30).stdout.strip() == "absent"
    finally:
        sbx.kill()


def test_pool_flags_that_cannot_work_are_refused_at_start():
    for flags, says in [
        (["--pool", "base"], "TEMPLATE[:TIER]=N"),
        (["--pool", "base=0"], "1 to 1000"),
        (["--pool", "base=1", "--pool", "base:ns=2"], "has a pool already"),
        (["--pool", "base=1", "--pool-memory", "lots"], "--pool-memory"),
        (["--pool", "no-such-template=1"], "no such template"),
    ]:
        import subprocess

        p = subprocess.run([os.environ["CORDON_BIN"], "serve", "--listen", "127.0.0.1:0", *flags], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, (flags, p.returncode, p.stderr)
        line = p.stderr.strip().splitlines()[-1]
        assert says in line, (flags, line)


def test_with_an_open_default_a_pooled_sandbox_takes_the_create_s_policy(tmp_path):
    log = open(tmp_path / "serve.log", "w")
    srv = Serve("--network-default", "open", "--pool", "base=1", log=log).start()
    try:
        wait_ready(srv, ("base", "ns"), 1)
        sbx = Sandbox.create(timeout=60, network={"deny_out": ["198.51.100.0/24"]}, **srv.sdk())
        try:
            assert pools(srv)[("base", "ns")]["taken"] == 1
            net = srv.api("GET", f"/sandboxes/{sbx.sandbox_id}").json()["network"]
            assert net["denyOut"] == ["198.51.100.0/24"], net
            out = sbx.commands.run(DIAL.format(ip="198.51.100.9") + " || true", timeout=60).stdout
            assert_refused_at_once(out)
            trail = srv.api("GET", f"/sandboxes/{sbx.sandbox_id}/audit").json()["blockedConnections"]
            assert any("198.51.100.9" in b["destination"] for b in trail), trail
        finally:
            sbx.kill()
    finally:
        srv.stop()
        log.close()


@needs_runsc
def test_a_gvisor_pool_hands_over_with_the_create_s_env(tmp_path):
    log = open(tmp_path / "serve.log", "w")
    srv = Serve("--pool", "base:gvisor=1", log=log).start()
    try:
        wait_ready(srv, ("base", "gvisor"), 1)
        r = srv.api("POST", "/sandboxes", json={"templateID": "base", "tier": "gvisor", "timeout": 60, "envVars": {"POOL_ENV": "gv"}, "memoryMB": 256})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        try:
            assert pools(srv)[("base", "gvisor")]["taken"] == 1
            sbx = Sandbox.connect(sid, **srv.sdk())
            out = sbx.commands.run("echo $POOL_ENV; hostname", timeout=60).stdout.split()
            assert out == ["gv", sid], out
            # The cap written is the sandbox's plus what runsc and gVisor's kernel take.
            assert memory_limit(sid) > 256 << 20
        finally:
            srv.api("DELETE", f"/sandboxes/{sid}")
    finally:
        srv.stop()
        log.close()


@needs_qemu
def test_a_vm_pool_hands_over_a_running_guest_and_keeps_it_for_a_create_of_its_size(tmp_path):
    log = open(tmp_path / "serve.log", "w")
    srv = Serve("--pool", "base:vm=1", log=log).start()
    try:
        wait_ready(srv, ("base", "vm"), 1, within=600)
        # A guest's memory is fixed at boot: a create of another size starts its own VM and
        # leaves the pooled one waiting.
        r = srv.api("POST", "/sandboxes", json={"templateID": "base", "tier": "vm", "timeout": 60, "memoryMB": 256})
        assert r.status_code == 201, r.text
        srv.api("DELETE", f"/sandboxes/{r.json()['sandboxID']}")
        p = pools(srv)[("base", "vm")]
        assert (p["taken"], p["ready"]) == (0, 1), p
        r = srv.api("POST", "/sandboxes", json={"templateID": "base", "tier": "vm", "timeout": 60, "envVars": {"POOL_ENV": "vm"}})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        try:
            assert pools(srv)[("base", "vm")]["taken"] == 1
            out = Sandbox.connect(sid, **srv.sdk()).commands.run("echo $POOL_ENV; hostname", timeout=120).stdout.split()
            assert out == ["vm", sid], out
        finally:
            srv.api("DELETE", f"/sandboxes/{sid}")
    finally:
        srv.stop()
        log.close()


def test_a_code_interpreter_pool_answers_the_first_cell(tmp_path):
    from e2b_code_interpreter import Sandbox as CodeSandbox

    log = open(tmp_path / "serve.log", "w")
    srv = Serve("--pool", "code-interpreter-v1=1", log=log).start()
    try:
        wait_ready(srv, ("code-interpreter-v1", "ns"), 1)
        sbx = CodeSandbox.create(timeout=60, **srv.sdk())
        try:
            assert pools(srv)[("code-interpreter-v1", "ns")]["taken"] == 1
            assert sbx.run_code("1+1").text == "2"
        finally:
            sbx.kill()
    finally:
        srv.stop()
        log.close()
