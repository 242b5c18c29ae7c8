"""`cordon serve --network-default open`: E2B's network semantics through the real SDK (no rules
is the internet, `denyOut` alone a blocklist, `update_network({})` open again,
`allow_internet_access=False` closed), the policy in force reported by `get_info`'s `network`,
and every refusal failing at once. A server of its own is started here. Only refused TEST-NET
addresses are dialled (never anything the policy allows), so nothing leaves the machine."""

import os

import httpx
import pytest
from e2b import Sandbox

from test_network_api import DIAL, assert_refused_at_once
from test_server import KEY, Server

H = {"X-API-KEY": KEY}


@pytest.fixture(scope="module")
def open_server():
    srv = Server("--network-default", "open")
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=KEY)
    try:
        yield srv
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        srv.stop()


def network(srv, sid):
    r = httpx.get(f"{srv.url}/sandboxes/{sid}", headers=H, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["network"]


def dial(sbx, ip):
    r = sbx.commands.run(DIAL.format(ip=ip) + " || true", timeout=60)
    return r.stdout


def test_no_rules_is_the_internet_deny_alone_a_blocklist_and_an_empty_update_open_again(open_server):
    sbx = Sandbox.create(timeout=120)
    try:
        net = network(open_server, sbx.sandbox_id)
        assert (net["default"], net["allowOut"], net["denyOut"]) == ("open", ["0.0.0.0/0", "::/0"], []), net
        # It has an interface, as an E2B sandbox does.
        assert len(sbx.commands.run("cat /proc/net/route", timeout=30).stdout.strip().splitlines()) > 1
        # A blocklist: what it names is refused at once, and recorded.
        sbx.update_network({"deny_out": ["198.51.100.0/24"]})
        net = network(open_server, sbx.sandbox_id)
        assert net["denyOut"] == ["198.51.100.0/24"] and "0.0.0.0/0" in net["allowOut"], net
        assert_refused_at_once(dial(sbx, "198.51.100.9"))
        trail = httpx.get(f"{open_server.url}/sandboxes/{sbx.sandbox_id}/audit", headers=H).json()["blockedConnections"]
        assert any("198.51.100.9" in b["destination"] for b in trail), trail
        # update_network({}) is the open default again.
        sbx.update_network({})
        assert network(open_server, sbx.sandbox_id)["denyOut"] == []
        # allow_internet_access=False closes everything; a connection is refused at once.
        sbx.update_network({"allow_internet_access": False})
        net = network(open_server, sbx.sandbox_id)
        assert (net["default"], net["allowOut"]) == ("closed", []), net
        assert_refused_at_once(dial(sbx, "198.51.100.9"))
    finally:
        sbx.kill()


def test_e2bs_allowlist_idiom_and_a_closed_create(open_server):
    # Deny all traffic, allow one address: everything else is refused, IPv6 included.
    sbx = Sandbox.create(timeout=120, network={"allow_out": ["203.0.113.7"], "deny_out": ["0.0.0.0/0"]})
    try:
        net = network(open_server, sbx.sandbox_id)
        assert net["denyOut"] == ["0.0.0.0/0", "::/0"] and "203.0.113.7/32" in net["allowOut"], net
        assert_refused_at_once(dial(sbx, "198.51.100.9"))
    finally:
        sbx.kill()
    closed = Sandbox.create(timeout=120, allow_internet_access=False)
    try:
        net = network(open_server, closed.sandbox_id)
        assert (net["default"], net["allowOut"]) == ("closed", []), net
        assert closed.commands.run("cat /proc/net/route", timeout=30).stdout.strip().count("\n") == 0
    finally:
        closed.kill()
