"""Secrets injected at egress through the real `e2b` package: `Secret.create` and a sandbox whose
`network` names a rule with `Secret.fill(...)`; an HTTPS server outside that echoes request
headers receives the real value, while inside the sandbox only the placeholder exists.

The outside is a network namespace this test makes, on TEST-NET-3 (203.0.113.64/26, checked
unrouted with `ip route get` first), holding an HTTPS echo server whose certificate a test CA
signed. A second `cordon serve` on the suite's state dir is started with `--upstream-ca` naming
that CA (the suite's server trusts the host's store, which does not know it). The sandbox
reaches the server by address (`allowOut`), naming it `api.e2b.test` in SNI; the forwarder
terminates TLS for that name only, because the rule names it."""

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid

import httpx
import pytest
from e2b import Sandbox, Secret

from conftest import API_KEY, Serve, needs_qemu
from test_network_api import DIAL, assert_refused_at_once

STATE = os.environ.get("CORDON_HOME", "/var/lib/cordon")
NS = f"cordon-e2b-inj-{os.getpid()}"
HOST_IP, SERVER_IP, PREFIX = "203.0.113.65", "203.0.113.70", 26
# An address of the test's subnet that nothing holds: no rule opens it unless a test says so.
OTHER_IP = "203.0.113.71"
NAME = "api.e2b.test"

SERVER = textwrap.dedent(
    """
    import http.server, json, ssl, sys
    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_GET(self):
            body = json.dumps({"path": self.path, "host": self.headers.get("Host"), "headers": [[k, v] for k, v in self.headers.items()]}).encode()
            with open(sys.argv[2], "a") as f:
                f.write(body.decode() + "\\n")
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    srv = http.server.ThreadingHTTPServer((sys.argv[1], 443), H)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(sys.argv[3], sys.argv[4])
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    srv.serve_forever()
    """
)


# The same echo over HTTP/2 (and HTTP/1.1), as an ASGI app under hypercorn on port 8443: the
# forwarder speaks whichever the host takes.
H2_SERVER = textwrap.dedent(
    """
    import json, os
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        path = scope["path"] + ("?" + scope["query_string"].decode() if scope["query_string"] else "")
        body = json.dumps({"path": path, "version": scope["http_version"], "headers": [[k.decode(), v.decode()] for k, v in scope["headers"]]})
        with open(os.environ["ECHO_LOG"], "a") as f:
            f.write(body + "\\n")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body.encode()})
    """
)


def sh(*args, check=True):
    return subprocess.run(args, check=check, capture_output=True, text=True)


def route_dev(ip):
    out = sh("ip", "route", "get", ip, check=False).stdout
    parts = out.split()
    return parts[parts.index("dev") + 1] if "dev" in parts else ""


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a network namespace")
    d = tmp_path_factory.mktemp("inject")
    # Unused means: no route of its own, only the default one (if any).
    default = sh("ip", "route", "show", "default", check=False).stdout.split()
    default_dev = default[default.index("dev") + 1] if "dev" in default else ""
    if route_dev(SERVER_IP) not in ("", default_dev):
        pytest.skip(f"{SERVER_IP} already has a route of its own on this host ({route_dev(SERVER_IP)})")
    ca_key, ca, key, csr, cert = (str(d / n) for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=cordon e2b test CA")
    sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={NAME}")
    ext = d / "ext.cnf"
    ext.write_text(f"subjectAltName=DNS:{NAME}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
    sh("openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", str(ext))
    host_if, ns_if = f"ci{os.getpid() % 100000}", f"cn{os.getpid() % 100000}"
    sh("ip", "netns", "add", NS)
    server = h2 = None
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", NS)
        sh("ip", "addr", "add", f"{HOST_IP}/{PREFIX}", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{SERVER_IP}/{PREFIX}", "dev", ns_if)
        sh("ip", "netns", "exec", NS, "ip", "link", "set", ns_if, "up")
        sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
        assert route_dev(SERVER_IP) == host_if, "the test address does not route to the test's namespace"
        log = d / "echo.log"
        log.touch()
        (d / "server.py").write_text(SERVER)
        server = subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, str(d / "server.py"), SERVER_IP, str(log), cert, key])
        (d / "h2echo.py").write_text(H2_SERVER)
        h2 = subprocess.Popen(
            ["ip", "netns", "exec", NS, sys.executable, "-m", "hypercorn", "--certfile", cert, "--keyfile", key, "--bind", f"{SERVER_IP}:8443", "h2echo:app"],
            cwd=d, env={**os.environ, "ECHO_LOG": str(log)}, stdout=open(d / "h2.out", "wb"), stderr=subprocess.STDOUT,
        )
        for _ in range(100):
            listening = sh("ip", "netns", "exec", NS, "ss", "-ltn", check=False).stdout
            if ":443 " in listening and ":8443 " in listening:
                break
            time.sleep(0.1)
        yield {"ca": ca, "log": log}
    finally:
        for p in (server, h2):
            if p:
                p.kill()
                p.wait()
        sh("ip", "link", "del", host_if, check=False)
        sh("ip", "netns", "del", NS, check=False)


@pytest.fixture(scope="module")
def server(outside, tmp_path_factory):
    """A `cordon serve` that verifies upstream hosts against the test CA."""
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log_path, "wb") as log:
        srv = Serve("-vv", "--state-dir", STATE, "--upstream-ca", outside["ca"], log=log).start()
    try:
        yield {"opts": srv.sdk(), "url": srv.url, "log": log_path}
    finally:
        srv.stop()


def echoes(outside, tag):
    lines = outside["log"].read_text().splitlines()
    return [e for e in map(json.loads, lines) if tag in e["path"]]


def header(echo, name):
    return [v for k, v in echo["headers"] if k.lower() == name.lower()]


def test_the_sdk_injects_a_secret_that_the_sandbox_never_holds(outside, server):
    value, value2 = f"sk-{uuid.uuid4().hex}", f"sk-{uuid.uuid4().hex}"
    name = f"inj-{uuid.uuid4().hex[:10]}"
    opts = server["opts"]
    Secret.create(name, value, **opts)
    tag = uuid.uuid4().hex
    try:
        sbx = Sandbox.create(
            network={
                "allow_out": [SERVER_IP],
                "rules": {NAME: [{"transform": {"headers": {"Authorization": f"Bearer {Secret.fill(name)}"}}}]},
            },
            timeout=120,
            **opts,
        )
        try:
            # The placeholder the sandbox sees, sent by the sandbox itself to the rule's host; the
            # sandbox trusts the forwarder's certificate without flags.
            # The echo server would hand the header back: the sandbox discards the body (an upstream
            # that reflects a credential gives it away, whoever injects it).
            curl = f"curl -sS --fail -o /dev/null --resolve {NAME}:443:{SERVER_IP} -H 'Authorization: placeholder' https://{NAME}/echo?t={tag}"
            r = sbx.commands.run(curl)
            assert r.exit_code == 0, r.stderr
            assert value not in r.stdout
            # HTTP/2 both ways: the sandbox's curl and the host (hypercorn) each speak it.
            h2 = f"curl -sS --fail --http2 -o /dev/null -w '%{{http_version}}' --resolve {NAME}:8443:{SERVER_IP} https://{NAME}:8443/echo?t={tag}-h2"
            r = sbx.commands.run(h2 + "; true")
            why = httpx.get(f"{server['url']}/sandboxes/{sbx.sandbox_id}/audit", headers={"X-API-KEY": API_KEY}, timeout=30).text
            assert r.stdout == "2", f"{r.stdout} {r.stderr} {why}"
            # A new value applies to the next request, with no change to the sandbox.
            Secret.update(name, value2, **opts)
            r = sbx.commands.run(curl.replace(f"t={tag}", f"t={tag}-2"))
            assert r.exit_code == 0, r.stderr
            # Nowhere inside: environment, every process's, the files a user can read.
            r = sbx.commands.run("env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; grep -rIl sk- /etc /home /tmp 2>/dev/null; true", user="root")
            assert value not in r.stdout and value2 not in r.stdout
            info = Sandbox.get_info(sbx.sandbox_id, **opts)
            raw = httpx.get(f"{server['url']}/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": API_KEY}, timeout=30).json()
            assert raw["network"]["rules"] == {NAME: [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets." + name + "}"}}}]}
            assert value not in json.dumps(raw) and info.sandbox_id == sbx.sandbox_id
            audit = httpx.get(f"{server['url']}/sandboxes/{sbx.sandbox_id}/audit", headers={"X-API-KEY": API_KEY}, timeout=30).json()
            assert {"host": NAME, "header": "authorization", "count": 3} in audit["injectedHeaders"], audit
            assert value not in json.dumps(audit)
        finally:
            sbx.kill()
        got = echoes(outside, tag)
        assert len(got) == 3, got
        first, over_h2, after_update = got
        assert header(first, "authorization") == [f"Bearer {value}"], got
        assert over_h2["version"] == "2" and header(over_h2, "authorization") == [f"Bearer {value}"], over_h2
        assert header(after_update, "authorization") == [f"Bearer {value2}"], got
    finally:
        Secret.destroy(name, **opts)
    log = server["log"].read_text(errors="replace")
    assert value not in log and value2 not in log


def test_rules_are_checked_like_e2b(server):
    opts = server["opts"]
    url = server["url"]

    def create(network):
        return httpx.post(f"{url}/sandboxes", headers={"X-API-KEY": API_KEY}, json={"templateID": "base", "network": network}, timeout=60)

    ok = {"allowOut": [SERVER_IP]}
    cases = [
        ({**ok, "rules": {NAME: [{"transform": {"headers": {"X": "${e2b.secrets.no-such-secret}"}}}]}}, "does not exist"),
        ({**ok, "rules": {NAME: [{}, {}]}}, "at most 1"),
        ({**ok, "rules": {"*": []}}, "not a DNS name"),
        ({**ok, "rules": {NAME: [{"transform": {"headers": {"X": "${e2b.secrets.a"}}}]}}, "not closed"),
        ({**ok, "rules": {NAME: [{"transform": {"headers": {"X": "${e2b.identity.tokens.aws}"}}}]}}, "identity tokens"),
        ({**ok, "rules": {NAME: [{"transform": {"headers": {"Bad Header": "v"}}}]}}, "header name"),
        ({**ok, "rules": {f"h{i}.e2b.test": [] for i in range(11)}}, "at most 10"),
    ]
    for network, want in cases:
        r = create(network)
        assert r.status_code == 400 and want in r.text, (network, r.status_code, r.text)
    # The same checks on an update of a running sandbox, whose rules are replaced whole.
    value = f"sk-{uuid.uuid4().hex}"
    name = f"upd-{uuid.uuid4().hex[:10]}"
    Secret.create(name, value, **opts)
    try:
        sbx = Sandbox.create(network={"allow_out": [SERVER_IP]}, timeout=120, **opts)
        try:
            put = lambda body: httpx.put(f"{url}/sandboxes/{sbx.sandbox_id}/network", headers={"X-API-KEY": API_KEY}, json=body, timeout=30)
            assert put({**ok, "rules": {NAME: [{"transform": {"headers": {"X": "${e2b.secrets.nope}"}}}]}}).status_code == 400
            assert put({**ok, "rules": {NAME: [{"transform": {"headers": {"X-Key": Secret.fill(name)}}}]}}).status_code == 204
            raw = httpx.get(f"{url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": API_KEY}, timeout=30).json()
            assert list(raw["network"]["rules"]) == [NAME]
            assert put(ok).status_code == 204
            raw = httpx.get(f"{url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": API_KEY}, timeout=30).json()
            assert raw["network"]["rules"] == {}
        finally:
            sbx.kill()
    finally:
        Secret.destroy(name, **opts)


@needs_qemu
def test_a_vm_sandbox_reaches_the_allowed_host_only_with_its_secret_injected_and_updates_take_effect(outside, server):
    """The same policy on the vm tier: the guest's frames reach the same forwarder, which lets it
    reach the allowed host (with the rule's secret injected, the guest trusting the forwarder's
    certificate without flags), refuses another address at once, and obeys `update_network`."""
    opts, url = server["opts"], server["url"]
    h = {"X-API-KEY": API_KEY}
    value, name, tag = f"sk-{uuid.uuid4().hex}", f"inj-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    Secret.create(name, value, **opts)
    try:
        rules = {NAME: [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets." + name + "}"}}}]}
        r = httpx.post(
            f"{url}/sandboxes",
            headers=h,
            json={"templateID": "base", "tier": "vm", "timeout": 300, "network": {"allowOut": [SERVER_IP], "rules": rules}},
            timeout=300,
        )
        assert r.status_code == 201, r.text
        sbx = Sandbox.connect(r.json()["sandboxID"], **opts)
        try:
            curl = f"curl -sS --fail --max-time 20 -o /dev/null --resolve {NAME}:443:{SERVER_IP} https://{NAME}/echo?t={tag}"
            r = sbx.commands.run(curl, timeout=120)
            assert r.exit_code == 0, r.stderr
            # An address no rule opens: refused at once, and in the trail.
            out = sbx.commands.run(DIAL.format(ip=OTHER_IP) + " || true", timeout=60).stdout
            assert_refused_at_once(out)
            trail = lambda: httpx.get(f"{url}/sandboxes/{sbx.sandbox_id}/audit", headers=h, timeout=30).json()["blockedConnections"]
            assert any(OTHER_IP in b["destination"] for b in trail()), trail()
            # The update swaps the two: the echo server is refused from now on.
            sbx.update_network({"allow_out": [OTHER_IP]})
            net = httpx.get(f"{url}/sandboxes/{sbx.sandbox_id}", headers=h, timeout=30).json()["network"]
            assert net["allowOut"] == [f"{OTHER_IP}/32"], net
            r = sbx.commands.run(curl.replace(f"t={tag}", f"t={tag}-after") + " || echo refused", timeout=120)
            assert "refused" in r.stdout, r
            assert any(SERVER_IP in b["destination"] for b in trail()), trail()
        finally:
            sbx.kill()
        got = echoes(outside, tag)
        assert len(got) == 1 and header(got[0], "authorization") == [f"Bearer {value}"], got
    finally:
        Secret.destroy(name, **opts)
