"""Restarts that keep sandboxes (`cordon serve --shutdown keep`): a server stopped with SIGTERM,
then one killed with `kill -9`, and each time the next server on the same state directory adopts
what ran: the same ids and tokens (the SDK objects made before go on working), metadata, the
same processes (a background job keeps its pid, a server inside keeps answering through the
server's port forwarding), files, the paused state, and the egress policy (an allowed TEST-NET
host in a namespace of the test's own answers; a blocked one is refused and audited). A sandbox
whose deadline passed while no server ran is ended by the next one.

The same holds for gvisor and vm sandboxes, networked or not; two servers sharing a state
directory never take each other's live sandboxes."""

import os
import signal
import subprocess
import time

import httpx
import pytest
from e2b import Sandbox

from conftest import DENIED_SYSCALL, Serve, needs_qemu, needs_runsc, route_dev, sh

NS = f"cordon-e2b-restart-{os.getpid()}"
HOST_IP, NS_IP, PREFIX = "198.51.100.245", "198.51.100.246", 30
BLOCKED_IP = "203.0.113.78"

FETCH = (
    "python3 -c \"import socket,sys; s=socket.socket(); s.settimeout(10)\n"
    "try:\n s.connect(('{ip}', 80)); s.sendall(b'GET /hello HTTP/1.0\\r\\n\\r\\n'); d=b''\n"
    " while (c := s.recv(4096)): d += c\n"
    " print(d.decode(errors='replace'))\n"
    "except OSError as e: print('refused', e)\""
)


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """A TEST-NET address in a namespace of the test's own, where an HTTP server answers."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a network namespace")
    default = sh("ip", "route", "show", "default", check=False).stdout.split()
    default_dev = default[default.index("dev") + 1] if "dev" in default else ""
    if route_dev(NS_IP) not in ("", default_dev):
        pytest.skip(f"{NS_IP} already has a route of its own on this host ({route_dev(NS_IP)})")
    www = tmp_path_factory.mktemp("www")
    (www / "hello").write_text("hello from outside")
    host_if, ns_if = f"rh{os.getpid() % 100000}", f"rn{os.getpid() % 100000}"
    sh("ip", "netns", "add", NS)
    web = None
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", NS)
        sh("ip", "addr", "add", f"{HOST_IP}/{PREFIX}", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/{PREFIX}", "dev", ns_if)
        sh("ip", "netns", "exec", NS, "ip", "link", "set", ns_if, "up")
        assert route_dev(NS_IP) == host_if, "the test address does not route to the test's namespace"
        web = subprocess.Popen(["ip", "netns", "exec", NS, "python3", "-m", "http.server", "80", "--bind", NS_IP, "--directory", str(www)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            if "LISTEN" in sh("ip", "netns", "exec", NS, "ss", "-ltn", check=False).stdout:
                break
            time.sleep(0.1)
        yield NS_IP
    finally:
        if web:
            web.kill()
            web.wait()
        sh("ip", "link", "del", host_if, check=False)
        sh("ip", "netns", "del", NS, check=False)


def iso_s(t):
    """Seconds since the epoch of an RFC 3339 time with up to nanoseconds, as the API writes it."""
    import datetime
    whole, _, frac = t.rstrip("Z").partition(".")
    base = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.timezone.utc).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def alive(pid):
    return os.path.exists(f"/proc/{pid}")


def gone(pid, within=10):
    """Whether process `pid` is gone within `within` seconds (an orphan's parent is whatever
    reaps orphans here, which may take a moment to)."""
    deadline = time.monotonic() + within
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


def init_pid(sid):
    """The host pid of the sandbox's init, from the run ledger's record."""
    import json
    with open(f"{os.environ.get('CORDON_HOME', '/var/lib/cordon')}/run/{sid}/record.json") as f:
        return json.load(f)["pid"]


def check_running(srv, sbx, job, web_host):
    """Everything of a running sandbox that must outlive the server."""
    # The SDK object made before the restart: the same id and envd token.
    assert sbx.commands.run(f"kill -0 {job} && echo alive", timeout=60).stdout.strip() == "alive"
    assert sbx.files.read("/home/user/kept") == "across restarts"
    # A process started before answers through the server's port forwarding.
    r = httpx.get(srv.url + "/kept", headers={"Host": web_host}, timeout=30)
    assert r.status_code == 200 and r.text == "across restarts", r.text


def test_sandboxes_outlive_a_sigterm_and_a_kill_9_of_the_server(tmp_path, outside):
    log = open(tmp_path / "serve.log", "ab")
    srv = Serve("--shutdown", "keep", log=log).start()
    made = []
    try:
        plain = Sandbox.create(timeout=600, metadata={"who": "plain"}, envs={"KEPT": "yes"}, **srv.sdk())
        made.append(plain.sandbox_id)
        plain.files.write("/home/user/kept", "across restarts")
        job = plain.commands.run("sleep 3600", background=True).pid
        plain.commands.run("cd /home/user && python3 -m http.server 8000", background=True)
        web_host = plain.get_host(8000)
        for _ in range(100):
            if plain.commands.run("ss -ltn | grep -q ':8000 ' && echo up || true").stdout.strip() == "up":
                break
            time.sleep(0.1)

        net = Sandbox.create(timeout=600, network={"allow_out": [outside], "deny_out": ["0.0.0.0/0"]}, **srv.sdk())
        made.append(net.sandbox_id)
        assert "hello from outside" in net.commands.run(FETCH.format(ip=outside), timeout=60).stdout

        paused = Sandbox.create(timeout=600, **srv.sdk())
        made.append(paused.sandbox_id)
        paused_job = paused.commands.run("sleep 3600", background=True).pid
        assert paused.pause()

        # Its deadline passes while no server runs: the next one ends it.
        short = Sandbox.create(timeout=5, **srv.sdk())
        short_pid = init_pid(short.sandbox_id)

        inits = {sid: init_pid(sid) for sid in made}
        net_info = srv.api("GET", f"/sandboxes/{net.sandbox_id}").json()
        # A denied syscall is recorded and refused with EPERM while the server that made the
        # sandbox holds its filter's listener.
        assert plain.commands.run(DENIED_SYSCALL, timeout=60).stdout.strip() == "1"
        filter_before = srv.api("GET", f"/sandboxes/{plain.sandbox_id}/isolation").json()["seccomp"]
        assert "EPERM" in filter_before["notified"], filter_before

        for how in (signal.SIGTERM, signal.SIGKILL):
            srv.stop(how)
            # Nothing of them ended with the server.
            assert all(alive(p) for p in inits.values()), f"a sandbox died with the server ({how})"
            if how == signal.SIGTERM:
                assert srv.proc.returncode == 0, (tmp_path / "serve.log").read_text()
                # Long enough for the short one's deadline to pass meanwhile.
                time.sleep(6)
            srv.start()

            listed = {s.sandbox_id: s for s in Sandbox.list(**srv.sdk()).next_items()}
            for sid in made:
                assert sid in listed, f"{sid} not adopted after {how}: {sorted(listed)}"
            # The same processes: adopted, not made again.
            assert {sid: init_pid(sid) for sid in made} == inits
            info = srv.api("GET", f"/sandboxes/{plain.sandbox_id}").json()
            assert info["metadata"] == {"who": "plain"}, info
            assert plain.commands.run("echo $KEPT").stdout.strip() == "yes"
            check_running(srv, plain, job, web_host)
            # The same filter, whose listener went with the old server: the kernel answers
            # ENOSYS for it, and the report says so rather than promise a record.
            filter_now = srv.api("GET", f"/sandboxes/{plain.sandbox_id}/isolation").json()["seccomp"]
            assert filter_now["sha256"] == filter_before["sha256"], (filter_before, filter_now)
            assert "ENOSYS" in filter_now["notified"], filter_now
            assert plain.commands.run(DENIED_SYSCALL, timeout=60).stdout.strip() == "38"

            # The egress policy holds: the allowed host answers, the rest is refused and audited.
            assert srv.api("GET", f"/sandboxes/{net.sandbox_id}").json().get("network") == net_info.get("network")
            got = net.commands.run(FETCH.format(ip=outside), timeout=60).stdout
            assert "hello from outside" in got, f"after {how}: {got}"
            got = net.commands.run(FETCH.format(ip=BLOCKED_IP), timeout=60).stdout
            assert "refused" in got, f"after {how}: {got}"
            blocked = []
            for _ in range(50):
                blocked = [b for b in srv.api("GET", f"/sandboxes/{net.sandbox_id}/audit").json()["blockedConnections"] if BLOCKED_IP in b["destination"]]
                if blocked:
                    break
                time.sleep(0.1)
            assert blocked, "the adopted forwarder did not refuse (or did not record) a blocked destination"

            # Still paused, and its job is there after the resume.
            assert srv.api("GET", f"/sandboxes/{paused.sandbox_id}").json()["state"] == "paused"
            again = Sandbox.connect(paused.sandbox_id, **srv.sdk())
            assert again.commands.run(f"kill -0 {paused_job} && echo alive").stdout.strip() == "alive"
            assert again.pause()

            # The deadline that passed while no server ran was applied.
            deadline = time.monotonic() + 30
            while srv.api("GET", f"/sandboxes/{short.sandbox_id}").status_code != 404 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert srv.api("GET", f"/sandboxes/{short.sandbox_id}").status_code == 404
            for _ in range(100):
                if not alive(short_pid):
                    break
                time.sleep(0.1)
            assert not alive(short_pid), "the expired sandbox's processes outlived it"

        # Killed through the last server, they leave nothing behind.
        for sid in made:
            assert Sandbox.kill(sid, **srv.sdk())
        home = os.environ.get("CORDON_HOME", "/var/lib/cordon")
        for sid, pid in inits.items():
            for _ in range(100):
                if not alive(pid):
                    break
                time.sleep(0.1)
            assert not alive(pid)
            assert not os.path.exists(f"{home}/run/{sid}")
            assert not os.path.exists(f"{home}/live/{sid}.json")
    finally:
        for sid in made:
            try:
                Sandbox.kill(sid, **srv.sdk())
            except Exception:
                pass
        srv.stop()
        log.close()


@needs_runsc
def test_gvisor_sandboxes_outlive_a_sigterm_and_a_kill_9_of_the_server(tmp_path, outside):
    """The same for the gvisor tier, whose agent's link a holder process serves (so that the
    server's end is not the link's): the same runsc processes after each restart, one sandbox
    with an egress policy among them."""
    log = open(tmp_path / "serve.log", "ab")
    srv = Serve("--shutdown", "keep", log=log).start()
    made = []
    home = os.environ.get("CORDON_HOME", "/var/lib/cordon")

    def runsc_pid(sid):
        import json
        with open(f"{home}/gvisor/run/{sid}/record.json") as f:
            return json.load(f)["pid"]

    try:
        r = srv.api("POST", "/sandboxes", json={"templateID": "base", "tier": "gvisor", "timeout": 600, "metadata": {"who": "gvisor"}})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        made.append(sid)
        r = srv.api("POST", "/sandboxes", json={"templateID": "base", "tier": "gvisor", "timeout": 600, "network": {"allowOut": [outside], "denyOut": ["0.0.0.0/0"]}})
        assert r.status_code == 201, r.text
        nid = r.json()["sandboxID"]
        made.append(nid)
        sbx, net = Sandbox.connect(sid, **srv.sdk()), Sandbox.connect(nid, **srv.sdk())
        job = sbx.commands.run("sleep 3600", background=True).pid
        sbx.files.write("/home/user/kept", "across restarts")
        assert "hello from outside" in net.commands.run(FETCH.format(ip=outside), timeout=120).stdout
        end = srv.api("GET", f"/sandboxes/{sid}").json()["endAt"]
        pids = {i: runsc_pid(i) for i in made}
        for how in (signal.SIGTERM, signal.SIGKILL):
            srv.stop(how)
            assert all(alive(p) for p in pids.values()), f"a gvisor sandbox died with the server ({how})"
            srv.start()
            info = srv.api("GET", f"/sandboxes/{sid}").json()
            assert (info["state"], info["metadata"]) == ("running", {"who": "gvisor"}), info
            assert abs(iso_s(info["endAt"]) - iso_s(end)) < 0.01, (info["endAt"], end)
            # Adopted, not made again: the same runsc processes.
            assert {i: runsc_pid(i) for i in made} == pids
            # The SDK objects made before the restart: the same ids and envd tokens.
            assert sbx.commands.run(f"kill -0 {job} && echo alive", timeout=120).stdout.strip() == "alive"
            assert sbx.files.read("/home/user/kept") == "across restarts"
            got = net.commands.run(FETCH.format(ip=outside), timeout=120).stdout
            assert "hello from outside" in got, f"after {how}: {got}"
            got = net.commands.run(FETCH.format(ip=BLOCKED_IP), timeout=120).stdout
            assert "refused" in got, f"after {how}: {got}"
        for i in made:
            assert Sandbox.kill(i, **srv.sdk())
        for i, p in pids.items():
            for _ in range(100):
                if not alive(p):
                    break
                time.sleep(0.1)
            assert not alive(p)
            assert not os.path.exists(f"{home}/gvisor/run/{i}")
            assert not os.path.exists(f"{home}/live/{i}.json")
    finally:
        for i in made:
            try:
                Sandbox.kill(i, **srv.sdk())
            except Exception:
                pass
        srv.stop()
        log.close()


def test_a_server_never_adopts_the_sandboxes_of_another_that_runs(tmp_path):
    """Two servers on one state directory: the second leaves the first's live sandbox alone (its
    locks are held); once the first is killed, a third adopts it."""
    logs = [open(tmp_path / f"serve-{i}.log", "ab") for i in range(3)]
    a = Serve("--shutdown", "keep", log=logs[0]).start()
    b = c = None
    sid = None
    try:
        sbx = Sandbox.create(timeout=600, **a.sdk())
        sid = sbx.sandbox_id
        pid = init_pid(sid)
        b = Serve("--shutdown", "keep", log=logs[1]).start()
        assert b.api("GET", f"/sandboxes/{sid}").status_code == 404
        assert sbx.commands.run("echo still-a").stdout.strip() == "still-a"
        a.stop(signal.SIGKILL)
        c = Serve("--shutdown", "keep", log=logs[2]).start()
        assert c.api("GET", f"/sandboxes/{sid}").status_code == 200
        assert init_pid(sid) == pid
        # The one that started while the first still ran did not take it meanwhile.
        assert b.api("GET", f"/sandboxes/{sid}").status_code == 404
        assert Sandbox.kill(sid, **c.sdk())
    finally:
        for srv in (a, b, c):
            if srv and sid:
                try:
                    Sandbox.kill(sid, **srv.sdk())
                except Exception:
                    pass
        for srv in (a, b, c):
            if srv:
                srv.stop()
        for f in logs:
            f.close()


def vmm_pid(sid):
    """The host pid of a vm sandbox's VMM, from the vm tier's run ledger."""
    import json
    with open(f"{os.environ.get('CORDON_HOME', '/var/lib/cordon')}/vm/run/{sid}/record.json") as f:
        return json.load(f)["pid"]


def link_holders(sid):
    """Pids of the processes serving a sandbox's links (`cordon __vm-link .../<sid>/...`)."""
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 2 and argv[1] == b"__vm-link" and f"/{sid}/".encode() in argv[2]:
            found.append(int(p))
    return found


@needs_qemu
def test_vm_sandboxes_outlive_a_sigterm_and_a_kill_9_of_the_server(tmp_path, outside):
    """A VM's agent link and its monitor's and network link's host ends are held by a holder
    process, so its VMM runs on through a SIGTERM and a `kill -9` of the server; the next
    server adopts it with its guest, processes, files and egress policy, and can still pause
    (save through the adopted monitor) and resume it."""
    log = open(tmp_path / "serve.log", "ab")
    srv = Serve("--shutdown", "keep", log=log).start()
    made = []
    try:
        r = srv.api("POST", "/sandboxes", json={"templateID": "base", "tier": "vm", "timeout": 900, "metadata": {"who": "vm"}})
        assert r.status_code == 201, r.text
        plain = Sandbox.connect(r.json()["sandboxID"], **srv.sdk())
        made.append(plain.sandbox_id)
        job = plain.commands.run("sleep 3600", background=True, timeout=300).pid
        plain.files.write("/home/user/kept", "across restarts")
        policy = {"allowOut": [outside], "denyOut": ["0.0.0.0/0"]}
        r = srv.api("POST", "/sandboxes", json={"templateID": "base", "tier": "vm", "timeout": 900, "network": policy})
        assert r.status_code == 201, r.text
        net = Sandbox.connect(r.json()["sandboxID"], **srv.sdk())
        made.append(net.sandbox_id)
        assert "hello from outside" in net.commands.run(FETCH.format(ip=outside), timeout=300).stdout
        vmms = {sid: vmm_pid(sid) for sid in made}
        holders = {sid: link_holders(sid) for sid in made}
        assert all(len(h) == 1 for h in holders.values()), holders

        for how in (signal.SIGTERM, signal.SIGKILL):
            srv.stop(how)
            assert all(alive(p) for p in vmms.values()), f"a VM died with the server ({how})"
            if how == signal.SIGTERM:
                assert srv.proc.returncode == 0, (tmp_path / "serve.log").read_text()
            srv.start()
            listed = {s.sandbox_id for s in Sandbox.list(**srv.sdk()).next_items()}
            assert set(made) <= listed, f"not adopted after {how}: {sorted(listed)}"
            # The same VMMs and holders: adopted, not restored or booted again.
            assert {sid: vmm_pid(sid) for sid in made} == vmms
            assert {sid: link_holders(sid) for sid in made} == holders
            info = srv.api("GET", f"/sandboxes/{plain.sandbox_id}").json()
            assert (info["state"], info["metadata"]) == ("running", {"who": "vm"}), info
            # The SDK objects made before the restart: the same ids and tokens, the same guests.
            assert plain.commands.run(f"kill -0 {job} && echo alive", timeout=300).stdout.strip() == "alive"
            assert plain.files.read("/home/user/kept") == "across restarts"
            got = net.commands.run(FETCH.format(ip=outside), timeout=300).stdout
            assert "hello from outside" in got, f"after {how}: {got}"
            got = net.commands.run(FETCH.format(ip=BLOCKED_IP), timeout=300).stdout
            assert "refused" in got, f"after {how}: {got}"

        # A pause saves the adopted VM through its adopted monitor, the holder parks its agent;
        # the resume brings the same guest back.
        assert plain.pause()
        assert gone(vmms[plain.sandbox_id]) and all(gone(h) for h in holders[plain.sandbox_id])
        again = Sandbox.connect(plain.sandbox_id, **srv.sdk())
        assert again.commands.run(f"kill -0 {job} && echo alive", timeout=300).stdout.strip() == "alive"
        assert again.files.read("/home/user/kept") == "across restarts"

        # Killed through the last server, they leave nothing behind: no VMM, holder or record.
        home = os.environ.get("CORDON_HOME", "/var/lib/cordon")
        resumed = vmm_pid(plain.sandbox_id)
        for sid in made:
            assert Sandbox.kill(sid, **srv.sdk())
        for pid in [resumed, vmms[net.sandbox_id], *holders[net.sandbox_id]]:
            assert gone(pid), f"process {pid} outlived its sandbox"
        for sid in made:
            assert link_holders(sid) == []
            assert not os.path.exists(f"{home}/vm/run/{sid}")
            assert not os.path.exists(f"{home}/live/{sid}.json")
    finally:
        for sid in made:
            try:
                Sandbox.kill(sid, **srv.sdk())
            except Exception:
                pass
        srv.stop()
        log.close()


@needs_runsc
def test_ten_sandboxes_of_two_tiers_outlive_a_sigterm_and_a_kill_9(tmp_path, outside):
    """The whole: ten live sandboxes on the ns and gvisor tiers, two of them with egress
    policies and one paused, through a SIGTERM and then a `kill -9` of their server; after each
    restart every one is listed with its state and works with what it had."""
    log = open(tmp_path / "serve.log", "ab")
    srv = Serve("--shutdown", "keep", log=log).start()
    policy = {"allowOut": [outside], "denyOut": ["0.0.0.0/0"]}
    plan = [("ns", None)] * 6 + [("gvisor", None)] * 2 + [("ns", policy), ("gvisor", policy)]
    made = []
    try:
        for i, (tier, network) in enumerate(plan):
            body = {"templateID": "base", "tier": tier, "timeout": 900, "metadata": {"n": str(i)}}
            if network:
                body["network"] = network
            r = srv.api("POST", "/sandboxes", json=body)
            assert r.status_code == 201, r.text
            sbx = Sandbox.connect(r.json()["sandboxID"], **srv.sdk())
            job = sbx.commands.run("sleep 3600", background=True, timeout=120).pid
            sbx.files.write("/home/user/kept", f"sandbox {i}")
            made.append((sbx, job, network is not None))
        paused = made[1][0]
        assert paused.pause()
        for how in (signal.SIGTERM, signal.SIGKILL):
            srv.stop(how)
            srv.start()
            listed = {s.sandbox_id for s in Sandbox.list(**srv.sdk()).next_items()}
            for i, (sbx, job, networked) in enumerate(made):
                assert sbx.sandbox_id in listed, f"sandbox {i} ({plan[i][0]}) is not listed after {how}"
                info = srv.api("GET", f"/sandboxes/{sbx.sandbox_id}").json()
                assert info["metadata"] == {"n": str(i)}, info
                assert info["state"] == ("paused" if sbx is paused else "running"), info
                if sbx is paused:
                    continue
                assert sbx.commands.run(f"kill -0 {job} && echo alive", timeout=120).stdout.strip() == "alive", f"sandbox {i} after {how}"
                assert sbx.files.read("/home/user/kept") == f"sandbox {i}"
                if networked:
                    got = sbx.commands.run(FETCH.format(ip=outside), timeout=120).stdout
                    assert "hello from outside" in got, f"sandbox {i} after {how}: {got}"
                    got = sbx.commands.run(FETCH.format(ip=BLOCKED_IP), timeout=120).stdout
                    assert "refused" in got, f"sandbox {i} after {how}: {got}"
            # The paused one resumes with its job, and is paused again for the next round.
            again = Sandbox.connect(paused.sandbox_id, **srv.sdk())
            assert again.commands.run(f"kill -0 {made[1][1]} && echo alive").stdout.strip() == "alive"
            assert again.files.read("/home/user/kept") == "sandbox 1"
            assert again.pause()
        for sbx, _, _ in made:
            assert Sandbox.kill(sbx.sandbox_id, **srv.sdk())
        home = os.environ.get("CORDON_HOME", "/var/lib/cordon")
        for sbx, _, _ in made:
            assert not os.path.exists(f"{home}/live/{sbx.sandbox_id}.json")
    finally:
        for sbx, _, _ in made:
            try:
                Sandbox.kill(sbx.sandbox_id, **srv.sdk())
            except Exception:
                pass
        srv.stop()
        log.close()
