"""Ports other than envd: get_host() and E2b-Sandbox-Port reach a server inside the sandbox."""

import time

import httpx

from conftest import BASE_URL


def _wait_for_port(sbx, port):
    for _ in range(50):
        r = httpx.get(BASE_URL + "/", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(port)})
        if r.status_code == 200:
            return r
        time.sleep(0.1)
    raise AssertionError(f"port {port} never answered: {r.status_code} {r.text}")


def test_http_server_inside(sandbox):
    sandbox.files.write("/home/user/www/hello.txt", "from inside")
    sandbox.commands.run("cd /home/user/www && python3 -m http.server 8080", background=True)
    _wait_for_port(sandbox, 8080)
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8080"}
    r = httpx.get(BASE_URL + "/hello.txt", headers=headers)
    assert r.status_code == 200 and r.text == "from inside"
    # The Host form that get_host() returns, sent to the one port.
    host = sandbox.get_host(8080)
    assert host.startswith(f"8080-{sandbox.sandbox_id}.")
    r = httpx.get(BASE_URL + "/hello.txt", headers={"Host": host})
    assert r.status_code == 200 and r.text == "from inside"
    # Keep-alive: several requests over one client connection.
    with httpx.Client() as c:
        for _ in range(5):
            assert c.get(BASE_URL + "/hello.txt", headers=headers).text == "from inside"


def test_closed_port_is_502(sandbox):
    r = httpx.get(BASE_URL + "/", headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8081"})
    assert r.status_code == 502
    assert "port is not open" in r.json()["message"]


def test_unknown_sandbox_is_502():
    r = httpx.get(BASE_URL + "/", headers={"E2b-Sandbox-Id": "i00000000000000000000", "E2b-Sandbox-Port": "8080"})
    assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"


UPGRADE_SERVER = r'''
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8090))
s.listen()
while True:
    c, _ = s.accept()
    head = b""
    while b"\r\n\r\n" not in head:
        head += c.recv(1024)
    if b"upgrade: echo" not in head.lower():
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        c.close()
        continue
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
    while True:
        d = c.recv(1024)
        if not d:
            break
        c.sendall(d.upper())
    c.close()
'''


def test_protocol_upgrade_passthrough(sandbox):
    """What a websocket server needs: the upgrade reaches it, then bytes flow both ways."""
    import socket
    from urllib.parse import urlparse

    sandbox.files.write("/tmp/upgrade_server.py", UPGRADE_SERVER)
    sandbox.commands.run("python3 /tmp/upgrade_server.py", background=True)
    _wait_for_port(sandbox, 8090)
    u = urlparse(BASE_URL)
    c = socket.create_connection((u.hostname, u.port), timeout=10)
    c.sendall(
        (
            "GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: echo\r\n"
            f"E2b-Sandbox-Id: {sandbox.sandbox_id}\r\nE2b-Sandbox-Port: 8090\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += c.recv(1024)
    assert head.startswith(b"HTTP/1.1 101"), head
    for word in (b"hello", b"again"):
        c.sendall(word)
        got = b""
        while len(got) < len(word):
            got += c.recv(1024)
        assert got == word.upper()
    c.close()
