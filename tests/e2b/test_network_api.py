"""Egress rules and the audit trail through the API: E2B's `network.allowOut` / `denyOut` in the
create body and `PUT /sandboxes/{id}/network`, and cordon's `GET /sandboxes/{id}/audit`. The
forwarder's behaviour toward real hosts is proven by crates/cli/tests/egress.rs against a test
internet; here the point is that the API reaches it. Every address used is TEST-NET, which no
rule here opens, so nothing leaves the machine."""

import time

import httpx
import pytest
from e2b import CommandExitException, Sandbox

from conftest import API_KEY, API_URL, needs_runsc

H = {"X-API-KEY": API_KEY}

# Connects to a TEST-NET address on port 80 and sends a request. The forwarder refuses with a
# RST (at once where the address settles it, after the first bytes where it must see a name),
# so a refusal shows as a refused or reset connection; exit 0 means an answer came back.
DIAL = (
    "python3 -c \"import socket,sys; s=socket.socket(); s.settimeout(10)\n"
    "try:\n s.connect(('{ip}', 80)); s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); d=s.recv(100)\n"
    " if d: print('answered'); sys.exit(0)\n"
    " print('refused: closed')\n"
    "except OSError as e: print('refused', e)\n"
    "sys.exit(1)\""
)


def blocked_to(sid, ip):
    """The trail's entries for `ip`, waiting a little: the forwarder records as it refuses."""
    for _ in range(50):
        hits = [b for b in audit(sid)["blockedConnections"] if ip in b["destination"]]
        if hits:
            return hits
        time.sleep(0.1)
    return []


def create(body):
    r = httpx.post(f"{API_URL}/sandboxes", headers=H, json={"templateID": "base", "timeout": 120, **body}, timeout=120)
    return r


def audit(sid):
    r = httpx.get(f"{API_URL}/sandboxes/{sid}/audit", headers=H, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_denied_syscalls_are_in_the_audit_trail():
    sbx = Sandbox.create(timeout=120)
    try:
        out = sbx.commands.run("unshare -U true || echo denied", timeout=60)
        assert "denied" in out.stdout, out
        a = audit(sbx.sandbox_id)
        names = {d["syscall"] for d in a["deniedSyscalls"]}
        assert "unshare" in names, a
        assert a["blockedConnections"] == [], a
    finally:
        sbx.kill()
    assert httpx.get(f"{API_URL}/sandboxes/{sbx.sandbox_id}/audit", headers=H).status_code == 404


def assert_refused_at_once(out):
    """A refusal the client saw as one (a reset or refused connection), not its own timeout."""
    assert "refused" in out and "timed out" not in out, out


def dial(sbx, ip):
    try:
        return sbx.commands.run(DIAL.format(ip=ip), timeout=60).stdout
    except CommandExitException as e:
        return e.stdout


@pytest.mark.parametrize(
    "tier",
    ["ns", pytest.param("gvisor", marks=needs_runsc)],
)
def test_network_rules_from_the_create_body_and_their_update(tier):
    # No port in the rules, so Landlock leaves connect alone and the forwarder is the one to refuse.
    r = create({"network": {"allowOut": ["198.51.100.0/25"], "denyOut": ["198.51.100.9"]}, "tier": tier})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    sbx = Sandbox.connect(sid)
    try:
        # The sandbox has an interface now (a closed sandbox has loopback only).
        routes = sbx.commands.run("cat /proc/net/route", timeout=30).stdout
        assert len(routes.strip().splitlines()) > 1, routes
        # Outside the allowed range: the forwarder refuses it and says so in the trail.
        assert_refused_at_once(dial(sbx, "198.51.100.200"))
        assert blocked_to(sid, "198.51.100.200"), audit(sid)
        # GET reports the policy in force, in cordon's rule forms.
        net = httpx.get(f"{API_URL}/sandboxes/{sid}", headers=H).json()["network"]
        assert (net["allowOut"], net["denyOut"]) == (["198.51.100.0/25"], ["198.51.100.9/32"]), net

        # An update replaces the rules; attempts under the new ones are recorded too.
        r = httpx.put(f"{API_URL}/sandboxes/{sid}/network", headers=H, json={"allowOut": [], "denyOut": ["203.0.113.0/24"]})
        assert r.status_code == 204, r.text
        assert_refused_at_once(dial(sbx, "203.0.113.5"))
        assert blocked_to(sid, "203.0.113.5"), audit(sid)
        net = httpx.get(f"{API_URL}/sandboxes/{sid}", headers=H).json()["network"]
        assert (net["allowOut"], net["denyOut"]) == ([], ["203.0.113.0/24"]), net

        bad = httpx.put(f"{API_URL}/sandboxes/{sid}/network", headers=H, json={"allowOut": ["198.51.100.0/99"]})
        assert bad.status_code == 400, bad.text
        # A refused update changes nothing.
        assert httpx.get(f"{API_URL}/sandboxes/{sid}", headers=H).json()["network"]["denyOut"] == ["203.0.113.0/24"]
    finally:
        sbx.kill()


def test_a_closed_sandbox_cannot_be_opened_later():
    sbx = Sandbox.create(timeout=120)
    try:
        r = httpx.put(f"{API_URL}/sandboxes/{sbx.sandbox_id}/network", headers=H, json={"allowOut": ["pypi.org"]})
        assert r.status_code == 409, r.text
        assert sbx.commands.run("cat /proc/net/route", timeout=30).stdout.strip().count("\n") == 0
    finally:
        sbx.kill()


@pytest.mark.parametrize(
    "body,want",
    [
        ({"network": {"allowOut": ["198.51.100.0/99"]}}, "network"),
    ],
)
def test_bad_network_bodies_are_400(body, want):
    r = create(body)
    assert r.status_code == 400, r.text
    assert want in r.text


def test_allow_internet_access_false_keeps_it_closed():
    r = create({"allow_internet_access": False, "network": {"allowOut": ["198.51.100.0/24"]}})
    assert r.status_code == 201, r.text
    sbx = Sandbox.connect(r.json()["sandboxID"])
    try:
        assert sbx.commands.run("cat /proc/net/route", timeout=30).stdout.strip().count("\n") == 0
    finally:
        sbx.kill()
