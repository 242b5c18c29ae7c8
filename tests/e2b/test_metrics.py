"""`GET /metrics` and the JSON log of a server of its own (`--metrics-listen`,
`--metrics-per-sandbox`, `--pool base=1`, `--log-format json`): the exposition parses with the
`prometheus_client` package's Prometheus text-format parser (and its OpenMetrics parser when asked
for), and each counter moves as the test drives it: creates by source, failures by reason, ends by
reason, command latency, denied syscalls, egress flows allowed and blocked, pools; every log line
is one JSON object, and the lines about a request carry its id and the sandbox's."""

import json
import os

import httpx
import pytest
from e2b import Sandbox
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from conftest import API_KEY, Serve, free_port, route_dev, sh, until

# A namespace of the test's own with one TEST-NET address: the target of an allowed egress flow
# (nothing listens there, so the connection is refused after the policy let it out).
NS = f"cordon-e2b-metrics-{os.getpid()}"
HOST_IP, NS_IP, PREFIX = "198.51.100.241", "198.51.100.242", 30
BLOCKED_IP = "203.0.113.77"


@pytest.fixture(scope="module")
def outside():
    if os.geteuid() != 0:
        pytest.skip("needs root to make a network namespace")
    default = sh("ip", "route", "show", "default", check=False).stdout.split()
    default_dev = default[default.index("dev") + 1] if "dev" in default else ""
    if route_dev(NS_IP) not in ("", default_dev):
        pytest.skip(f"{NS_IP} already has a route of its own on this host ({route_dev(NS_IP)})")
    host_if, ns_if = f"mh{os.getpid() % 100000}", f"mn{os.getpid() % 100000}"
    sh("ip", "netns", "add", NS)
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", NS)
        sh("ip", "addr", "add", f"{HOST_IP}/{PREFIX}", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/{PREFIX}", "dev", ns_if)
        sh("ip", "netns", "exec", NS, "ip", "link", "set", ns_if, "up")
        assert route_dev(NS_IP) == host_if, "the test address does not route to the test's namespace"
        yield NS_IP
    finally:
        sh("ip", "link", "del", host_if, check=False)
        sh("ip", "netns", "del", NS, check=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("metrics") / "serve.log"
    mport = free_port()
    with open(log_path, "wb") as log:
        srv = Serve("--metrics-listen", f"127.0.0.1:{mport}", "--metrics-per-sandbox", "--pool", "base=1", "--log-format", "json", log=log).start()
    srv.metrics_url = f"http://127.0.0.1:{mport}/metrics"
    srv.log_path = log_path
    try:
        yield srv
    finally:
        srv.stop()


def samples(text):
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(srv):
    r = httpx.get(srv.metrics_url, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4"), r.headers
    return samples(r.text)


def value(m, name, **labels):
    """The sum of `name`'s samples whose labels include `labels` (0 when there is none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= set(ls))


def test_the_main_listener_asks_for_the_key_and_the_metrics_listener_serves_only_metrics(server):
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/metrics", headers={"X-API-KEY": "e2b_wrong"}).status_code == 401
    assert httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer e2b_wrong"}).status_code == 401
    for h in ({"X-API-KEY": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
        r = httpx.get(server.url + "/metrics", headers=h)
        assert r.status_code == 200, r.text
        assert "cordon_sandboxes_max" in r.text
    # The key-less listener answers nothing but /metrics: no API, no sandbox traffic.
    base = server.metrics_url.rsplit("/", 1)[0]
    assert httpx.get(base + "/sandboxes", headers={"X-API-KEY": API_KEY}).status_code == 404
    assert httpx.post(server.metrics_url).status_code == 405
    m = scrape(server)
    assert value(m, "cordon_sandboxes_max") == 100  # the default --max-sandboxes
    # OpenMetrics when a scraper asks for it, and it parses as such.
    r = httpx.get(server.metrics_url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["content-type"].startswith("application/openmetrics-text"), r.headers
    assert r.text.rstrip().endswith("# EOF")
    assert {"cordon_egress_flows", "cordon_sandboxes_max"} <= {f.name for f in openmetrics_families(r.text)}


def test_creates_commands_ends_and_pools_move_their_counters(server):
    until(lambda: value(scrape(server), "cordon_pool_sandboxes", template="base", state="ready") >= 1, "the pool to fill")
    before = scrape(server)
    assert value(before, "cordon_pool_size", template="base", tier="ns") == 1
    pooled = Sandbox.create(timeout=120, **server.sdk())
    # Another disk size: no pool matches, the create starts its own.
    r = server.api("POST", "/sandboxes", json={"templateID": "base", "timeout": 120, "diskSizeMB": 700})
    assert r.status_code == 201, r.text
    cold = Sandbox.connect(r.json()["sandboxID"], **server.sdk())
    try:
        for _ in range(3):
            assert pooled.commands.run("true", timeout=30).exit_code == 0
        m = scrape(server)
        d = lambda name, **l: value(m, name, **l) - value(before, name, **l)  # noqa: E731
        assert d("cordon_sandbox_creates_total", source="pool", template="base", tier="ns") == 1, m
        assert d("cordon_sandbox_creates_total", source="cold", template="base", tier="ns") == 1, m
        assert d("cordon_sandbox_create_seconds_count", tier="ns") == 2
        assert d("cordon_pool_taken_total", template="base") == 1
        assert d("cordon_command_seconds_count", tier="ns") == 3
        assert value(m, "cordon_command_seconds_sum", tier="ns") > value(before, "cordon_command_seconds_sum", tier="ns")
        # The gauge is what the API lists.
        listed = server.api("GET", "/sandboxes").json()
        assert value(m, "cordon_sandboxes", state="running") == len(listed) >= 2
        # Opt-in per-sandbox series, one per live sandbox.
        for sbx in (pooled, cold):
            assert value(m, "cordon_sandbox_memory_bytes", sandbox_id=sbx.sandbox_id) > 0, sbx.sandbox_id
            assert ("cordon_sandbox_cpu_seconds_total", (("sandbox_id", sbx.sandbox_id), ("template", "base"), ("tier", "ns"))) in m
    finally:
        pooled.kill()
        cold.kill()
    m = scrape(server)
    assert value(m, "cordon_sandbox_ends_total", reason="api") - value(before, "cordon_sandbox_ends_total", reason="api") == 2
    assert not any(n == "cordon_sandbox_memory_bytes" and ("sandbox_id", pooled.sandbox_id) in ls for (n, ls) in m)

    # A deadline that passes ends a sandbox as a timeout.
    short = Sandbox.create(timeout=1, **server.sdk())
    until(lambda: server.api("GET", f"/sandboxes/{short.sandbox_id}").status_code == 404, "the short sandbox's end")
    m = scrape(server)
    assert value(m, "cordon_sandbox_ends_total", reason="timeout") - value(before, "cordon_sandbox_ends_total", reason="timeout") == 1


def test_failed_creates_are_counted_by_reason(server):
    before = scrape(server)
    assert server.api("POST", "/sandboxes", json={"templateID": "no-such-template-x"}).status_code == 404
    m = scrape(server)
    d = lambda reason: value(m, "cordon_sandbox_create_failures_total", reason=reason) - value(before, "cordon_sandbox_create_failures_total", reason=reason)  # noqa: E731
    assert d("not_found") == 1, m
    assert d("failed") == 0, m


def test_denied_syscalls_and_egress_flows_count_and_never_go_down(server, outside):
    before = scrape(server)
    sbx = Sandbox.create(timeout=120, network={"allow_out": [outside]}, **server.sdk())
    try:
        out = sbx.commands.run("unshare -U true || echo denied", timeout=60)
        assert "denied" in out.stdout, out
        dial = "python3 -c \"import socket; s=socket.socket(); s.settimeout(5)\ntry: s.connect(('{ip}', 80))\nexcept OSError as e: print(e)\""
        sbx.commands.run(dial.format(ip=outside), timeout=60)
        sbx.commands.run(dial.format(ip=BLOCKED_IP), timeout=60)

        def moved():
            m = scrape(server)
            d = lambda name, **l: value(m, name, **l) - value(before, name, **l)  # noqa: E731
            ok = d("cordon_denied_syscalls_total") >= 1 and d("cordon_egress_flows_total", verdict="allowed") >= 1 and d("cordon_egress_flows_total", verdict="blocked") >= 1
            return m if ok else None

        during = until(moved, "the audit counters to move", secs=30)
    finally:
        sbx.kill()
    # The sandbox is gone; what it was refused stays counted.
    after = scrape(server)
    for name, labels in (("cordon_denied_syscalls_total", {}), ("cordon_egress_flows_total", {"verdict": "allowed"}), ("cordon_egress_flows_total", {"verdict": "blocked"})):
        assert value(after, name, **labels) >= value(during, name, **labels), (name, labels)


def test_the_log_is_json_lines_with_request_and_sandbox_ids(server):
    r = httpx.post(server.url + "/sandboxes", headers={"X-API-KEY": API_KEY, "X-Request-Id": "metrics-test-create-1"}, json={"templateID": "base", "timeout": 60, "diskSizeMB": 700}, timeout=120)
    assert r.status_code == 201, r.text
    assert r.headers["x-request-id"] == "metrics-test-create-1"
    sid = r.json()["sandboxID"]
    k = httpx.delete(f"{server.url}/sandboxes/{sid}", headers={"X-API-KEY": API_KEY})
    assert k.status_code == 204
    kill_id = k.headers["x-request-id"]
    assert len(kill_id) == 16 and int(kill_id, 16) >= 0
    # An id that could forge a log field is replaced.
    bad = httpx.get(server.url + "/health", headers={"X-Request-Id": '"}{"level":"ERROR'})
    assert bad.headers["x-request-id"] != '"}{"level":"ERROR'

    def lines():
        objs = []
        for line in server.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                objs.append(json.loads(line))  # every structured line is one JSON object
            else:
                # The few lines printed before logging starts are for the operator's eyes.
                assert line.startswith("cordon serve:"), line
        return objs

    def about(sid):
        return [o for o in lines() if o.get("sandbox_id") == sid]

    objs = until(lambda: len(about(sid)) >= 2 and about(sid), "the sandbox's log lines")
    created = next(o for o in objs if o.get("message") == "sandbox created")
    assert created["span"]["request_id"] == "metrics-test-create-1", created
    assert created["level"] == "INFO" and created["timestamp"], created
    destroyed = next(o for o in objs if o.get("message") == "sandbox destroyed")
    assert destroyed["span"]["request_id"] == kill_id and destroyed["reason"] == "killed by the API", destroyed
