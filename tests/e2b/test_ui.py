"""The dashboard at /ui in a real browser: headless Chromium driven over the DevTools protocol
(a small client over websocket-client), against the suite's `cordon serve`. Each step saves a
screenshot under target/ui-screenshots/ for a reviewer to look at."""

import base64
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import time

import httpx
import pytest
import websocket
from e2b import Sandbox

from conftest import API_KEY, API_URL, until

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHOTS = ROOT / "target" / "ui-screenshots"
WRONG_KEY = "e2b_" + "1" * 40
XSS = "<img src=x onerror=window.__xss=1>"


def deadline_poll(fn, what, timeout=30.0):
    """conftest's `until`, with this test's default wait and a 0.1 s poll."""
    return until(fn, what, timeout, every=0.1)


def ensure_chromium():
    path = shutil.which("chromium")
    if path:
        return path
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True)
        subprocess.run(cmd, env=env, check=True, capture_output=True)
    return shutil.which("chromium")


class Page:
    """One Chromium tab over the DevTools protocol."""

    def __init__(self, binary):
        self.profile = tempfile.mkdtemp(prefix="cordon-ui-chromium-")
        self.proc = subprocess.Popen(
            [
                binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--window-size=1400,1100",
                "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={self.profile}", "about:blank",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        port_file = pathlib.Path(self.profile) / "DevToolsActivePort"
        deadline_poll(lambda: port_file.exists() and port_file.read_text().strip(), "Chromium's DevTools port", 60)
        port = int(port_file.read_text().split()[0])
        targets = deadline_poll(
            lambda: [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"],
            "a page target", 30,
        )
        self.ws = websocket.create_connection(targets[0]["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.next_id = 0
        self.events = []
        self.call("Page.enable")
        self.call("Runtime.enable")

    def call(self, method, **params):
        self.next_id += 1
        my = self.next_id
        self.ws.send(json.dumps({"id": my, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == my:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def errors(self):
        """Uncaught exceptions and console errors of the page so far."""
        out = [e["params"]["exceptionDetails"] for e in self.events if e.get("method") == "Runtime.exceptionThrown"]
        out += [e["params"] for e in self.events if e.get("method") == "Runtime.consoleAPICalled" and e["params"].get("type") == "error"]
        return out

    def eval(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def goto(self, url):
        self.call("Page.navigate", url=url)
        deadline_poll(lambda: self.eval("document.readyState") == "complete", f"{url} to load")

    def text(self, selector):
        return self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); return e ? e.textContent : null; }})()")

    def visible(self, selector):
        return self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); return !!e && e.getClientRects().length > 0; }})()")

    def click(self, selector):
        assert self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return false; e.click(); return true; }})()"), selector

    def fill(self, selector, value):
        self.eval(f"document.querySelector({json.dumps(selector)}).value = {json.dumps(value)}")

    def key(self, key, text=None, code=None, vk=None, modifiers=0):
        down = {"type": "keyDown", "key": key, "modifiers": modifiers}
        if text is not None:
            down["text"] = text
        if code:
            down["code"] = code
        if vk:
            down["windowsVirtualKeyCode"] = vk
        self.call("Input.dispatchKeyEvent", **down)
        self.call("Input.dispatchKeyEvent", type="keyUp", key=key, modifiers=modifiers, **({"code": code} if code else {}))

    def type(self, s):
        for ch in s:
            self.key(ch, text=ch)

    def enter(self):
        self.key("Enter", text="\r", code="Enter", vk=13)

    def ctrl(self, letter):
        self.key(letter, code=f"Key{letter.upper()}", vk=ord(letter.upper()), modifiers=2)

    def shot(self, name):
        """The whole page, not only the window."""
        SHOTS.mkdir(parents=True, exist_ok=True)
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 6000), "scale": 1}
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip=clip)["data"]
        (SHOTS / f"{name}.png").write_bytes(base64.b64decode(data))

    def close(self):
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def page():
    # The screenshots of one run only.
    for old in SHOTS.glob("*.png"):
        old.unlink()
    p = Page(ensure_chromium())
    try:
        yield p
    finally:
        p.close()


def row_ids(page):
    return page.eval("[...document.querySelectorAll('#sandboxes-body tr')].map(r => r.dataset.id)")


def login(page, key):
    page.fill("#login-key", key)
    page.click("#login-submit")


def test_page_headers_and_no_data_without_key():
    r = httpx.get(f"{API_URL}/ui/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["referrer-policy"] == "no-referrer"
    assert "set-cookie" not in r.headers
    assert not re.search(r"<script(?![^>]*\bsrc=)", r.text), "inline script in the page"
    js = httpx.get(f"{API_URL}/ui/app.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert httpx.get(f"{API_URL}/ui/nope").status_code == 404
    # The data is behind the key.
    assert httpx.get(f"{API_URL}/sandboxes").status_code == 401
    assert httpx.get(f"{API_URL}/templates").status_code == 401


def test_templates_list_is_e2b_shaped_with_sizes():
    r = httpx.get(f"{API_URL}/templates", headers={"X-API-KEY": API_KEY})
    assert r.status_code == 200, r.text
    items = r.json()
    fields = {"templateID", "buildID", "cpuCount", "memoryMB", "diskSizeMB", "public", "aliases", "names", "createdAt",
              "updatedAt", "createdBy", "lastSpawnedAt", "spawnCount", "buildCount", "buildStatus", "envdVersion"}
    for t in items:
        assert fields <= set(t), set(fields) - set(t)
    base = [t for t in items if t["templateID"] == "base"]
    assert base and base[0]["sizeBytes"] > 0, items
    assert not [t for t in items if t["templateID"].startswith(("tpl-", "paused-", "own-"))]


def test_terminal_socket_checks_key_and_origin():
    sbx = Sandbox.create(timeout=120, metadata={"suite": "cordon"})
    try:
        url = API_URL.replace("http://", "ws://") + f"/ui/terminal/{sbx.sandbox_id}"
        origin = API_URL
        # Another site's page cannot open it.
        with pytest.raises(websocket.WebSocketBadStatusException) as e:
            websocket.create_connection(url, origin="http://evil.example", timeout=10)
        assert e.value.status_code == 403
        # A wrong key gets an error and a close, and nothing of the sandbox.
        ws = websocket.create_connection(url, origin=origin, timeout=10)
        ws.send(json.dumps({"type": "auth", "key": WRONG_KEY}))
        msg = json.loads(ws.recv())
        assert msg["type"] == "error" and "invalid API key" in msg["message"], msg
        op, frame = ws.recv_data(control_frame=True)
        assert op == websocket.ABNF.OPCODE_CLOSE and int.from_bytes(frame[:2], "big") == 4401
        ws.close()
        # The right key: a shell on a PTY.
        ws = websocket.create_connection(url, origin=origin, timeout=20)
        ws.send(json.dumps({"type": "auth", "key": API_KEY, "cols": 100, "rows": 30}))
        assert json.loads(ws.recv())["type"] == "ready"
        ws.send(json.dumps({"type": "input", "data": "stty size; echo sum-$((40+2))\r"}))
        out = b""
        end = time.monotonic() + 20
        while b"sum-42" not in out.replace(b"$((40+2))", b"") and time.monotonic() < end:
            op, data = ws.recv_data()
            if op == websocket.ABNF.OPCODE_BINARY:
                out += data
        assert b"30 100" in out and b"sum-42" in out.replace(b"$((40+2))", b""), out
        ws.send(json.dumps({"type": "resize", "cols": 77, "rows": 19}))
        ws.send(json.dumps({"type": "input", "data": "stty size\r"}))
        out = b""
        end = time.monotonic() + 20
        while b"19 77" not in out and time.monotonic() < end:
            op, data = ws.recv_data()
            if op == websocket.ABNF.OPCODE_BINARY:
                out += data
        assert b"19 77" in out, out
        ws.close()
    finally:
        sbx.kill()


def test_dashboard_flow(page):
    page.goto(f"{API_URL}/ui/")
    assert page.visible("#login-view")
    assert not page.visible("#nav") and not page.visible("#sandboxes-view")
    page.shot("01-login")

    # A wrong key: an error, no data, nothing kept.
    login(page, WRONG_KEY)
    deadline_poll(lambda: "Invalid API key" in (page.text("#login-error") or ""), "the wrong key's error")
    assert not page.visible("#sandboxes-view") and not page.visible("#nav")
    assert page.eval("document.querySelectorAll('#sandboxes-body tr').length") == 0
    assert page.eval("sessionStorage.getItem('cordon.apiKey')") is None
    page.shot("02-wrong-key")

    # The right key: kept in sessionStorage only (no cookie, not in the URL).
    login(page, API_KEY)
    deadline_poll(lambda: page.visible("#sandboxes-view"), "the sandbox list")
    assert page.eval("sessionStorage.getItem('cordon.apiKey')") == API_KEY
    assert page.eval("document.cookie") == ""
    assert API_KEY not in page.eval("location.href")
    page.shot("03-logged-in")

    # Templates and images with their sizes; the pools.
    page.click("#nav-templates")
    deadline_poll(lambda: page.visible("#templates-view") and page.text("#templates-body tr[data-id='base']"), "the base template's row")
    assert re.search(r"\d+(\.\d)? (MiB|GiB)", page.text("#templates-body tr[data-id='base']")), page.text("#templates-body tr[data-id='base']")
    page.shot("03a-templates")
    page.click("#nav-pools")
    deadline_poll(lambda: "Memory budget" in (page.text("#pools-budget") or ""), "the pools view")
    page.shot("03b-pools")
    page.click("#nav-sandboxes")
    deadline_poll(lambda: page.visible("#sandboxes-view"), "the sandbox list again")

    sbx = Sandbox.create(timeout=300, metadata={"suite": "cordon", "owner": "ui-test"})
    try:
        sid = sbx.sandbox_id
        deadline_poll(lambda: sid in row_ids(page), "the new sandbox in the list")
        row = f"#sandboxes-body tr[data-id='{sid}']"
        deadline_poll(lambda: "MiB" in (page.text(f"{row} td:nth-child(7)") or ""), "its memory use")
        cells = page.eval(f"[...document.querySelectorAll(\"{row} td\")].map(td => td.textContent)")
        assert cells[1] == "base" and cells[2] == "ns" and cells[3] == "running", cells
        assert "owner=ui-test" in cells[7], cells
        page.shot("04-sandbox-listed")

        # Details: limits, isolation report, audit, processes.
        page.click(f"{row} button.sandbox-link")
        deadline_poll(lambda: page.visible("#sandbox-view") and page.text("#sandbox-id") == sid, "the details view")
        deadline_poll(lambda: "512 MiB" in (page.text("#limits") or ""), "the limits")
        limits = page.text("#limits")
        assert "CPUs1" in limits and "disk" in limits, limits
        iso = deadline_poll(lambda: (page.text("#isolation") or "") if "Cgroup limits" in (page.text("#isolation") or "") else None, "the isolation report")
        assert "cordon.isolation/v1" in iso and "512.0 MiB" in iso and "Seccomp" in iso and "Mounts" in iso, iso
        deadline_poll(lambda: page.eval("document.querySelectorAll('#processes tbody tr').length") > 0, "the process list")
        assert page.text("#network")
        page.shot("05-details")

        # The terminal: keystrokes in, output out.
        page.click("#terminal-open")
        deadline_poll(lambda: "connected" in (page.text("#terminal-status") or ""), "the terminal to connect", 30)
        deadline_poll(lambda: "$" in (page.text("#terminal") or ""), "a prompt", 30)
        page.eval("document.getElementById('terminal').focus()")
        page.type("echo $((6*7))")
        page.enter()
        deadline_poll(lambda: re.search(r"^42\s*$", page.text("#terminal") or "", re.M), "42 in the terminal", 20)
        # Output that looks like markup stays text.
        page.type(f"echo '{XSS}' | tr a-z A-Z")
        page.enter()
        deadline_poll(lambda: XSS.upper() in (page.text("#terminal") or ""), "the echoed markup", 20)
        assert page.eval("document.querySelectorAll('#terminal img, #terminal b').length") == 0
        assert page.eval("typeof window.__xss") == "undefined"
        page.shot("06-terminal")

        # Ctrl-C reaches the foreground process.
        page.type("sleep 600")
        page.enter()
        time_typed = time.monotonic()
        deadline_poll(lambda: "sleep 600" in (page.text("#terminal") or ""), "the sleep to echo")
        page.ctrl("c")
        page.type("echo done-$((2+3))")
        page.enter()
        deadline_poll(lambda: re.search(r"^done-5\s*$", page.text("#terminal") or "", re.M), "the shell back after Ctrl-C", 20)
        assert time.monotonic() - time_typed < 600
        # The PTY's size is the element's, and follows it.
        size = page.eval("[term.size.cols, term.size.rows]")
        page.type("stty size")
        page.enter()
        deadline_poll(lambda: f"{size[1]} {size[0]}" in (page.text("#terminal") or ""), "stty to report the element's size", 20)
        page.shot("07-terminal-ctrl-c")
        page.call("Emulation.setDeviceMetricsOverride", width=900, height=1000, deviceScaleFactor=1, mobile=False)
        try:
            narrower = deadline_poll(
                lambda: (lambda s: s if s and s[0] < size[0] else None)(page.eval("term && [term.size.cols, term.size.rows]")),
                "the terminal to follow a narrower window",
            )
            page.type("clear; stty size")
            page.enter()
            deadline_poll(lambda: f"{narrower[1]} {narrower[0]}" in (page.text("#terminal") or ""), "stty to report the new size", 20)
            page.shot("08-terminal-resized")
        finally:
            page.call("Emulation.clearDeviceMetricsOverride")

        # Kill from the page: a second click confirms.
        page.click("#kill")
        deadline_poll(lambda: "again" in (page.text("#kill") or ""), "the kill confirmation")
        page.click("#kill")
        deadline_poll(lambda: page.visible("#sandboxes-view"), "back to the list")
        deadline_poll(lambda: page.eval("document.querySelectorAll('#sandboxes-body tr').length") is not None and sid not in row_ids(page), "the sandbox to leave the list")
        r = httpx.get(f"{API_URL}/sandboxes/{sid}", headers={"X-API-KEY": API_KEY})
        assert r.status_code == 404, r.text
        page.shot("09-killed")
        # The wrong key's 401 is the only error the page may have logged.
        errors = [e for e in page.errors() if "401" not in json.dumps(e)]
        assert not errors, errors
    finally:
        try:
            sbx.kill()
        except Exception:
            pass


def test_sandbox_strings_are_text_not_html(page):
    page.goto(f"{API_URL}/ui/")
    if page.visible("#login-view"):
        login(page, API_KEY)
    deadline_poll(lambda: page.visible("#sandboxes-view"), "the sandbox list")
    sbx = Sandbox.create(timeout=120, metadata={"suite": "cordon", "note": XSS})
    try:
        sid = sbx.sandbox_id
        deadline_poll(lambda: sid in row_ids(page), "the sandbox in the list")
        cell = page.text(f"#sandboxes-body tr[data-id='{sid}'] td.metadata")
        assert f"note={XSS}" in cell, cell
        assert page.eval("document.querySelectorAll('#sandboxes-body img').length") == 0
        page.click(f"#sandboxes-body tr[data-id='{sid}'] button.sandbox-link")
        deadline_poll(lambda: XSS in (page.text("#metadata") or ""), "the metadata in the details")
        assert page.eval("document.querySelectorAll('main img').length") == 0
        # Nothing ran.
        assert page.eval("typeof window.__xss") == "undefined"
        page.shot("10-xss-metadata-as-text")
    finally:
        sbx.kill()
