"""Three `cordon serve` nodes as one E2B endpoint, coordinated by a real etcd (Debian's
etcd-server), on this machine: separate state dirs and ports; uid ranges are taken from the
host-wide slot locks, so the nodes never share one.

The real `e2b` SDK pointed at node A creates 30 sandboxes, which land on all three nodes; each
runs commands and moves files through A and through C; B lists all 30 page by page; B is killed
with SIGKILL and its sandboxes answer as missing within the lease's TTL while creates go on
succeeding on A and C; a drain stops placement on a node and waits for its sandboxes."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time

import httpx
import pytest
from e2b import NotFoundException, Sandbox

from conftest import API_KEY, Serve, free_port, until

STATE = os.environ.get("CORDON_HOME", "/var/lib/cordon")
TTL_S = 4
H = {"X-API-KEY": API_KEY}

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (scripts/install-deps installs etcd-server)")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    d = tmp_path_factory.mktemp("etcd")
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    with open(d / "etcd.log", "wb") as log:
        proc = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", str(d / "data"), "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"t=http://127.0.0.1:{peer}"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (d / "etcd.log").read_text()[-2000:]
            time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait()


class Node:
    """One node: a state dir of its own (the suite's `base` image hard-linked in, so no node
    builds it again), its own port, the suite's key."""

    def __init__(self, name, etcd, root):
        self.name = name
        self.dir = root / name
        images = self.dir / "images"
        images.mkdir(parents=True, exist_ok=True)
        if os.path.isdir(f"{STATE}/images/base") and not (images / "base").exists():
            subprocess.run(["cp", "-al", f"{STATE}/images/base", str(images / "base")], check=True)
        self.etcd = etcd
        self.log_path = root / f"{name}.log"
        self.serve = None

    def start(self):
        port = free_port()
        with open(self.log_path, "ab") as log:
            self.serve = Serve("--state-dir", str(self.dir), "--cluster", f"etcd={self.etcd}", "--node-name", self.name,
                               "--advertise", f"http://127.0.0.1:{port}", "--cluster-ttl", f"{TTL_S}s", "--shutdown", "destroy", log=log)
            self.serve.port, self.serve.url = port, f"http://127.0.0.1:{port}"
            self.serve.start()
        self.url = self.serve.url
        return self

    def sdk(self):
        return {"api_url": self.url, "sandbox_url": self.url, "api_key": API_KEY}

    def own(self):
        """The ids this node itself holds (its own page, not the cluster's)."""
        r = httpx.get(self.url + "/cluster/v1/sandboxes", headers=H, timeout=30)
        assert r.status_code == 200, r.text
        return {i["sandbox"]["sandboxID"] for i in r.json()["items"]}


@pytest.fixture(scope="module")
def nodes(etcd):
    # Not under pytest's tmp dirs: a state dir's parents must let sandbox users through.
    root = pathlib.Path(tempfile.mkdtemp(prefix="cordon-cluster-"))
    root.chmod(0o755)
    started = []
    try:
        for n in ("nodea", "nodeb", "nodec"):
            started.append(Node(n, etcd, root).start())
        yield {n.name: n for n in started}
    finally:
        for n in started:
            # A node a failed test left dead still has its sandboxes running (kept for the next
            # server): one more start on its state dir adopts them, and its stop ends them.
            if n.serve and n.serve.proc.poll() is not None:
                try:
                    n.start()
                except AssertionError:
                    pass
            if n.serve and n.serve.proc.poll() is None:
                n.serve.stop()
        if not os.environ.get("KEEP_CLUSTER"):
            shutil.rmtree(root, ignore_errors=True)


def members(node):
    r = httpx.get(node.url + "/cluster/v1/nodes", headers=H, timeout=30)
    assert r.status_code == 200, r.text
    return {m["name"]: m for m in r.json()}


def test_every_node_sees_the_three(nodes):
    for n in nodes.values():
        until(lambda: set(members(n)) == {"nodea", "nodeb", "nodec"}, f"{n.name} sees the three nodes", 10)
    m = members(nodes["nodea"])["nodeb"]
    assert m["url"] == nodes["nodeb"].url and m["maxSandboxes"] == 100 and "ns" in m["tiers"] and m["freeMemory"] > 0


def test_thirty_sandboxes_through_a_spread_run_list_and_survive_the_loss_of_b(nodes):
    a, b, c = nodes["nodea"], nodes["nodeb"], nodes["nodec"]
    sbs = [Sandbox.create(timeout=300, metadata={"suite": "cluster", "n": str(i)}, **a.sdk()) for i in range(30)]
    try:
        ids = [s.sandbox_id for s in sbs]
        assert len(set(ids)) == 30
        # Each id names its node, and that node holds it: all three took some.
        by_node = {n: {i for i in ids if i[21:] == n} for n in nodes}
        assert all(by_node.values()), {n: len(v) for n, v in by_node.items()}
        for n, mine in by_node.items():
            assert mine <= nodes[n].own(), n

        # Commands and files through A (the SDK objects made there) and through C.
        for s in sbs:
            r = s.commands.run(f"echo {s.sandbox_id} > /tmp/who; hostname")
            assert r.exit_code == 0
            s.files.write("/home/user/through-a.txt", f"a:{s.sandbox_id}")
            via_c = Sandbox.connect(s.sandbox_id, **c.sdk())
            assert via_c.files.read("/tmp/who").strip() == s.sandbox_id
            assert via_c.files.read("/home/user/through-a.txt") == f"a:{s.sandbox_id}"
            via_c.files.write("/home/user/through-c.txt", f"c:{s.sandbox_id}")
            assert via_c.commands.run("cat /home/user/through-c.txt").stdout == f"c:{s.sandbox_id}"
            assert s.files.read("/home/user/through-c.txt") == f"c:{s.sandbox_id}"
            assert via_c.get_info().metadata["n"] == s.get_info().metadata["n"]

        # Old SDKs send the access token alone after a connect: it names the owner too.
        for s in sbs[:6]:
            r = httpx.post(f"{c.url}/filesystem.Filesystem/Stat", json={"path": "/tmp/who"}, timeout=30,
                           headers={"X-Access-Token": s._envd_access_token, "Connect-Protocol-Version": "1"})
            assert r.status_code == 200 and r.json()["entry"]["name"] == "who", (s.sandbox_id, r.status_code, r.text)

        # The metrics of sandboxes of every node, through one node.
        some = [sorted(v)[0] for v in by_node.values()]
        r = httpx.get(f"{c.url}/sandboxes/metrics", params={"sandbox_ids": ",".join(some)}, headers=H, timeout=30)
        assert r.status_code == 200, r.text
        got = r.json()["sandboxes"]
        assert set(got) == set(some) and all(m["cpuCount"] >= 1 and m["memTotal"] > 0 for m in got.values()), got
        assert httpx.get(f"{c.url}/sandboxes/metrics", headers=H).status_code == 400
        assert httpx.get(f"{c.url}/sandboxes/metrics", params={"sandbox_ids": f"{some[0]},{some[0]}"}, headers=H).status_code == 400

        # All 30 from B, seven to a page: no item twice, none missing, in order.
        pager = Sandbox.list(query=None, limit=7, api_key=API_KEY, api_url=b.url)
        pages = []
        while pager.has_next:
            pages.append(pager.next_items())
        listed = [x.sandbox_id for p in pages for x in p if x.metadata.get("suite") == "cluster"]
        assert sorted(listed) == sorted(ids)
        assert len(pages) == 5 and all(len(p) == 7 for p in pages[:4])
        starts = [x.started_at for p in pages for x in p]
        assert starts == sorted(starts, reverse=True)

        # B dies without a word.
        lost = sorted(by_node["nodeb"])
        b.serve.proc.send_signal(signal.SIGKILL)
        b.serve.proc.wait()
        killed_at = time.monotonic()
        # Creates go on (a create placed on B before the others notice goes to the next node).
        later = [Sandbox.create(timeout=120, metadata={"suite": "cluster-later"}, **a.sdk()) for _ in range(6)]
        sbs.extend(later)
        assert all(s.sandbox_id[21:] in ("nodea", "nodec") for s in later), [s.sandbox_id for s in later]
        assert all(s.commands.run("true").exit_code == 0 for s in later)

        def lost_everywhere():
            for front in (a, c):
                listed = {x.sandbox_id for x in Sandbox.list(api_key=API_KEY, api_url=front.url, limit=100).next_items()}
                if listed & set(lost):
                    return False
                for sid in lost:
                    if httpx.get(f"{front.url}/sandboxes/{sid}", headers=H, timeout=10).status_code != 404:
                        return False
            return "nodeb" not in members(a) and "nodeb" not in members(c)

        until(lost_everywhere, "B's sandboxes answer as missing on A and C, and B has left", TTL_S + 2)
        elapsed = time.monotonic() - killed_at
        assert elapsed <= TTL_S + 2, elapsed
        with pytest.raises(NotFoundException):
            Sandbox.connect(lost[0], **a.sdk())
        # The data plane of a lost sandbox fails at once, through either node.
        for s in sbs:
            if s.sandbox_id in lost:
                t = time.monotonic()
                with pytest.raises(Exception):
                    s.commands.run("true", request_timeout=10)
                assert time.monotonic() - t < 5
                break
        # A and C's sandboxes are untouched.
        for s in sbs:
            if s.sandbox_id not in lost:
                assert s.commands.run("cat /tmp/who || true").exit_code == 0

        # B comes back on its state dir: it takes its sandboxes over and they answer again.
        b.start()
        until(lambda: "nodeb" in members(a), "B is a member again", 10)
        back = Sandbox.connect(lost[0], **a.sdk())
        assert back.files.read("/tmp/who").strip() == lost[0]
    finally:
        for s in sbs:
            try:
                s.kill()
            except Exception:
                pass
    for n in nodes.values():
        until(lambda: not n.own(), f"{n.name} holds no sandbox", 30)


def test_a_drain_stops_placement_and_waits_for_the_node_to_empty(nodes):
    a, c = nodes["nodea"], nodes["nodec"]
    until(lambda: len(members(a)) == 3, "three nodes", 10)
    on_c = []
    while len(on_c) < 2:
        s = Sandbox.create(timeout=120, **a.sdk())
        if s.sandbox_id.endswith("nodec"):
            on_c.append(s)
        else:
            s.kill()
    cli = [os.environ["CORDON_BIN"], "node"]
    srv = ["--server", a.url, "--api-key", API_KEY]
    drain = subprocess.Popen([*cli, "drain", "nodec", *srv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        until(lambda: members(a)["nodec"]["draining"], "C is marked draining", 10)
        # Nothing new lands on C.
        made = [Sandbox.create(timeout=120, **a.sdk()) for _ in range(8)]
        assert not [s.sandbox_id for s in made if s.sandbox_id.endswith("nodec")]
        for s in made:
            s.kill()
        time.sleep(1)
        assert drain.poll() is None, "the drain returned while C still had sandboxes"
        for s in on_c:
            s.kill()
        out, err = drain.communicate(timeout=30)
        assert drain.returncode == 0, err
        assert "nodec: drained" in out
    finally:
        if drain.poll() is None:
            drain.kill()
        subprocess.run([*cli, "undrain", "nodec", *srv], check=True, capture_output=True)
    until(lambda: not members(a)["nodec"]["draining"], "C is placed on again", 10)
    listing = subprocess.run([*cli, "ls", *srv], check=True, capture_output=True, text=True).stdout
    assert all(n in listing for n in ("nodea", "nodeb", "nodec")), listing


def test_a_snapshot_taken_on_one_node_starts_sandboxes_through_any_node(nodes):
    a, c = nodes["nodea"], nodes["nodec"]
    src = Sandbox.create(timeout=120, **a.sdk())
    made = [src]
    try:
        owner = src.sandbox_id[21:]
        src.files.write("/home/user/kept.txt", "from the snapshot")
        snap = src.create_snapshot()
        # Once the owner has published that it holds the snapshot, a create of it through
        # another front door is placed there.
        for front in (c, a):
            until(lambda: snap.snapshot_id in members(front)[owner]["templates"], "the owner publishes the snapshot", 10)
        for front in (c, a):
            s = Sandbox.create(snap.snapshot_id, timeout=60, **front.sdk())
            made.append(s)
            assert s.sandbox_id[21:] == owner
            assert s.files.read("/home/user/kept.txt") == "from the snapshot"
        # With its node drained, a create of it lands elsewhere: that node copies the snapshot
        # (its record, and the layers it lacks) from its node first.
        drain = httpx.post(f"{a.url}/cluster/v1/nodes/{owner}/drain", headers=H, timeout=30)
        assert drain.status_code == 200, drain.text
        until(lambda: members(c)[owner]["draining"], "the owner is drained in C's view", 10)
        try:
            s = Sandbox.create(snap.snapshot_id, timeout=60, **c.sdk())
            made.append(s)
            elsewhere = s.sandbox_id[21:]
            assert elsewhere != owner
            assert s.files.read("/home/user/kept.txt") == "from the snapshot"
            s.files.write("/home/user/kept.txt", "changed in a copy")
            assert src.files.read("/home/user/kept.txt") == "from the snapshot"
            until(lambda: snap.snapshot_id in members(a)[elsewhere]["templates"], "the copy is published", 10)
        finally:
            httpx.delete(f"{a.url}/cluster/v1/nodes/{owner}/drain", headers=H, timeout=30)
        # Deleted through any node, it goes from every node that has it.
        assert Sandbox.delete_snapshot(snap.snapshot_id, api_key=API_KEY, api_url=a.url) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id, api_key=API_KEY, api_url=c.url) is False
        for n in (owner, elsewhere):
            until(lambda: snap.snapshot_id not in members(a)[n]["templates"], f"{n} no longer holds the snapshot", 10)
    finally:
        for s in made:
            s.kill()


def test_a_template_built_through_one_node_is_copied_where_its_sandboxes_land(nodes):
    from e2b import Template

    a, c = nodes["nodea"], nodes["nodec"]
    tpl = f"cluster-tpl-{os.getpid()}"
    Template.build(Template().from_template("base").run_cmd("echo built-on-a > /home/user/where.txt"), tpl, api_key=API_KEY, api_url=a.url)
    # It was built on A; with A drained, a create of it through C lands elsewhere, which copies
    # the template (its record and the image's layers it lacks) from A first.
    until(lambda: tpl in members(c)["nodea"]["templates"], "A publishes the template", 10)
    httpx.post(f"{a.url}/cluster/v1/nodes/nodea/drain", headers=H, timeout=30).raise_for_status()
    made = []
    try:
        until(lambda: members(c)["nodea"]["draining"], "A is drained in C's view", 10)
        for _ in range(2):
            s = Sandbox.create(tpl, timeout=60, **c.sdk())
            made.append(s)
            assert s.sandbox_id[21:] != "nodea"
            assert s.files.read("/home/user/where.txt").strip() == "built-on-a"
    finally:
        httpx.delete(f"{a.url}/cluster/v1/nodes/nodea/drain", headers=H, timeout=30)
        for s in made:
            s.kill()
    for n in {s.sandbox_id[21:] for s in made}:
        until(lambda: tpl in members(a)[n]["templates"], f"{n} publishes its copy", 10)


def test_bad_cluster_flags_and_a_taken_name_are_refused(etcd, nodes):
    state = tempfile.mkdtemp(prefix="cordon-refused-")
    os.chmod(state, 0o755)
    base = [os.environ["CORDON_BIN"], "serve", "--state-dir", state, "--listen", f"127.0.0.1:{free_port()}", "--api-key", API_KEY]
    for args, want in [
        (["--cluster", "http://127.0.0.1:1", "--node-name", "x", "--advertise", "http://127.0.0.1:1"], "etcd="),
        (["--cluster", f"etcd={etcd}", "--node-name", "Node-1", "--advertise", "http://127.0.0.1:1"], "--node-name"),
        (["--cluster", f"etcd={etcd}", "--node-name", "nodea", "--advertise", "http://127.0.0.1:9"], "taken by a live node"),
    ]:
        r = subprocess.run(base + args, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert want in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr
    # The live nodea is untouched by the refused one.
    assert json.loads(httpx.get(nodes["nodea"].url + "/health").text)["status"] == "ok"
    assert "nodea" in members(nodes["nodec"])
