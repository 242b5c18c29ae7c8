"""Who reaches a sandbox's own ports: `network.allowPublicTraffic` (E2B's traffic access token,
with E2B's 403s) and `network.maskRequestHost` (the Host the service inside sees), through the
official SDK's create options and the single port the SDK is pointed at."""

import time

import httpx
import pytest
from e2b import Sandbox

from conftest import API_KEY, API_URL, BASE_URL

TOKEN_HEADER = "e2b-traffic-access-token"

# Answers every request with the Host header it was given and whether a traffic token reached it.
ECHO_SERVER = r'''
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("host=%s token=%s" % (self.headers.get("Host"), self.headers.get("e2b-traffic-access-token"))).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), H).serve_forever()
'''


def _serve(sbx):
    sbx.files.write("/tmp/echo.py", ECHO_SERVER)
    sbx.commands.run("python3 /tmp/echo.py", background=True)


def _get(sbx, extra=None, use_host=False):
    headers = {"Host": sbx.get_host(8000)} if use_host else {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"}
    headers.update(extra or {})
    return httpx.get(BASE_URL + "/", headers=headers, timeout=30)


def _wait(sbx, extra=None):
    for _ in range(100):
        r = _get(sbx, extra)
        if r.status_code != 502:
            return r
        time.sleep(0.1)
    raise AssertionError(f"port 8000 never answered: {r.status_code} {r.text}")


def test_closed_to_the_public_takes_only_the_traffic_token():
    sbx = Sandbox.create(network={"allow_public_traffic": False}, timeout=120)
    try:
        token = sbx.traffic_access_token
        assert token, "no trafficAccessToken with allowPublicTraffic false"
        _serve(sbx)
        ok = _wait(sbx, {TOKEN_HEADER: token})
        # The service answers, and the token never reaches it.
        assert ok.status_code == 200 and ok.text.endswith("token=None"), ok.text
        # The Host form get_host() returns takes the token the same way.
        assert _get(sbx, {TOKEN_HEADER: token}, use_host=True).status_code == 200
        missing = _get(sbx)
        assert missing.status_code == 403, missing.text
        assert f"Token header '{TOKEN_HEADER}' is missing" in missing.text
        wrong = _get(sbx, {TOKEN_HEADER: token[:-1] + ("x" if token[-1] != "x" else "y")})
        assert wrong.status_code == 403, wrong.text
        assert f"Provided token in header '{TOKEN_HEADER}' is invalid" in wrong.text
        # The envd access token is not the traffic token: it does not open the port.
        assert _get(sbx, {"X-Access-Token": sbx._envd_access_token or "x"}).status_code == 403
        # envd keeps its own token: the SDK still runs commands.
        assert sbx.commands.run("echo envd").stdout == "envd\n"
        net = sbx.get_info().network or {}
        assert net.get("allow_public_traffic") is False, net
    finally:
        sbx.kill()


def test_open_to_the_public_by_default():
    sbx = Sandbox.create(timeout=120)
    try:
        _serve(sbx)
        r = _wait(sbx)
        assert r.status_code == 200, r.text
    finally:
        sbx.kill()


def test_mask_request_host_replaces_the_host_the_service_sees():
    sbx = Sandbox.create(network={"mask_request_host": "app.internal:${PORT}"}, timeout=120)
    try:
        _serve(sbx)
        r = _wait(sbx)
        assert r.status_code == 200 and r.text.startswith("host=app.internal:8000 "), r.text
        r = _get(sbx, use_host=True)
        assert r.text.startswith("host=app.internal:8000 "), r.text
    finally:
        sbx.kill()


@pytest.mark.parametrize("mask", ["not a host", "user@host", "host/path", ""])
def test_a_bad_mask_request_host_is_a_400_and_makes_nothing(mask):
    before = httpx.get(API_URL + "/v2/sandboxes", headers={"X-API-KEY": API_KEY}).json()
    r = httpx.post(
        API_URL + "/sandboxes",
        headers={"X-API-KEY": API_KEY},
        json={"templateID": "base", "network": {"maskRequestHost": mask}},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert "maskRequestHost" in r.json()["message"]
    after = httpx.get(API_URL + "/v2/sandboxes", headers={"X-API-KEY": API_KEY}).json()
    assert len(after) == len(before)
