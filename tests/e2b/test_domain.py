"""`cordon serve --domain D --tls-self-signed`: the SDK configured only with E2B_DOMAIN (no API or
sandbox URL) reaches the API at https://api.D and every sandbox at https://<port>-<id>.D, as it
does E2B's, websockets included. A second server is started here on a loopback address's port
443 (where such URLs point); the client runs in a mount namespace whose /etc/resolv.conf names a
resolver of the test's own (in this process) that answers D and *.D with that address, and it
trusts the CA the server wrote, through SSL_CERT_FILE. Nothing but loopback is used."""

import json
import os
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from conftest import API_KEY

DOMAIN = "cordon.test"
ADDR = "127.0.0.77"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")


def dns_server(stop):
    """A resolver for DOMAIN and its subdomains (A records to ADDR, nothing else: NXDOMAIN or an
    empty answer), on ADDR:53."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((ADDR, 53))
    s.settimeout(0.2)
    while not stop.is_set():
        try:
            q, peer = s.recvfrom(512)
        except socket.timeout:
            continue
        i, labels = 12, []
        while q[i]:
            labels.append(q[i + 1:i + 1 + q[i]].decode().lower())
            i += 1 + q[i]
        qtype = struct.unpack("!H", q[i + 1:i + 3])[0]
        name = ".".join(labels)
        ours = name == DOMAIN or name.endswith("." + DOMAIN)
        flags = 0x8180 if ours else 0x8183
        answer = b""
        if ours and qtype == 1:
            answer = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 5, 4) + socket.inet_aton(ADDR)
        head = q[:2] + struct.pack("!HHHHH", flags, 1, 1 if answer else 0, 0, 0)
        s.sendto(head + q[12:i + 5] + answer, peer)
    s.close()


@pytest.fixture(scope="module")
def domain_server():
    stop = threading.Event()
    dns = threading.Thread(target=dns_server, args=(stop,), daemon=True)
    dns.start()
    log = tempfile.NamedTemporaryFile(prefix="cordon-serve-domain-", suffix=".log", delete=False)
    srv = subprocess.Popen(
        [os.environ["CORDON_BIN"], "serve", "--listen", f"{ADDR}:443", "--api-key", API_KEY, "--max-sandboxes", "4",
         "--domain", DOMAIN, "--tls-self-signed"],
        stdout=log, stderr=subprocess.STDOUT)
    ca = None
    for _ in range(600):
        text = open(log.name).read()
        if "listening on" in text:
            ca = next(l.split("trust ", 1)[1].split()[0] for l in text.splitlines() if "trust " in l)
            break
        assert srv.poll() is None, text
        time.sleep(0.1)
    assert ca and os.path.exists(ca), open(log.name).read()
    try:
        yield ca
    finally:
        srv.terminate()
        srv.wait(timeout=60)
        stop.set()
        dns.join()


def test_the_create_answer_names_the_domain_and_tls_is_served(domain_server):
    ctx = ssl.create_default_context(cafile=domain_server)
    # Straight to the address, with the name the URL would carry (SNI and Host).
    with httpx.Client(verify=ctx) as c:
        r = c.post(f"https://{ADDR}/sandboxes", headers={"X-API-KEY": API_KEY, "Host": f"api.{DOMAIN}"},
                   json={"templateID": "base", "timeout": 60}, extensions={"sni_hostname": f"api.{DOMAIN}"}, timeout=120)
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        assert r.json()["domain"] == DOMAIN, r.json()
        info = c.get(f"https://{ADDR}/sandboxes/{sid}", headers={"X-API-KEY": API_KEY, "Host": f"api.{DOMAIN}"},
                     extensions={"sni_hostname": f"api.{DOMAIN}"})
        assert info.json()["domain"] == DOMAIN
        c.delete(f"https://{ADDR}/sandboxes/{sid}", headers={"X-API-KEY": API_KEY, "Host": f"api.{DOMAIN}"},
                 extensions={"sni_hostname": f"api.{DOMAIN}"})
    # A client that does not trust the CA is refused the handshake.
    with pytest.raises(ssl.SSLError):
        with socket.create_connection((ADDR, 443), timeout=10) as raw:
            ssl.create_default_context().wrap_socket(raw, server_hostname=f"api.{DOMAIN}")


# A websocket echo server (RFC 6455, one text frame), stdlib only, inside the sandbox.
WS_SERVER = r'''
import base64, hashlib, socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8765)); s.listen()
def recvn(c, n):
    b = b""
    while len(b) < n:
        b += c.recv(n - len(b))
    return b
while True:
    c, _ = s.accept()
    req = b""
    while b"\r\n\r\n" not in req:
        req += c.recv(4096)
    key = [l.split(b":", 1)[1].strip() for l in req.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key:")][0]
    acc = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + acc + b"\r\n\r\n")
    h = recvn(c, 2); mask = recvn(c, 4); data = bytearray(recvn(c, h[1] & 127))
    for i in range(len(data)):
        data[i] ^= mask[i % 4]
    c.sendall(bytes([0x81, len(data)]) + bytes(data))
    c.close()
'''

# The client: the SDK with E2B_DOMAIN only; then a websocket over wss:// to get_host(8765).
CLIENT = r'''
import base64, hashlib, json, os, socket, ssl, sys, time
from e2b import Sandbox
ws_server = sys.argv[1]
sbx = Sandbox.create(timeout=120)
out = {"id": sbx.sandbox_id}
try:
    out["echo"] = sbx.commands.run("echo hello from $(hostname)").stdout.strip()
    sbx.files.write("/tmp/ws.py", ws_server)
    sbx.commands.run("python3 /tmp/ws.py", background=True)
    host = sbx.get_host(8765)
    out["host"] = host
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    key = base64.b64encode(os.urandom(16))
    for attempt in range(100):
        try:
            c = ctx.wrap_socket(socket.create_connection((host, 443), timeout=10), server_hostname=host)
            c.sendall(b"GET /echo HTTP/1.1\r\nHost: " + host.encode() + b"\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: " + key + b"\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = c.recv(4096)
                if not chunk:
                    break
                head += chunk
            if head.startswith(b"HTTP/1.1 101"):
                break
            c.close()
        except OSError:
            pass
        time.sleep(0.1)
    out["status"] = head.split(b"\r\n", 1)[0].decode()
    want = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    out["accept_ok"] = want in head
    msg, mask = b"ping over wss", os.urandom(4)
    c.sendall(bytes([0x81, 0x80 | len(msg)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(msg)))
    frame = c.recv(2)
    out["frame"] = c.recv(frame[1] & 127).decode()
finally:
    sbx.kill()
print(json.dumps(out))
'''


def test_the_sdk_with_only_the_domain_reaches_sandboxes_and_websockets(domain_server, tmp_path):
    (tmp_path / "resolv.conf").write_text(f"nameserver {ADDR}\n")
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n")
    (tmp_path / "client.py").write_text(CLIENT)
    env = {k: v for k, v in os.environ.items() if k not in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG")}
    env.update(E2B_DOMAIN=DOMAIN, E2B_API_KEY=API_KEY, SSL_CERT_FILE=domain_server)
    script = (f"mount --bind {tmp_path}/resolv.conf /etc/resolv.conf && mount --bind {tmp_path}/hosts /etc/hosts && "
              f"exec {sys.executable} {tmp_path}/client.py \"$0\"")
    r = subprocess.run(["unshare", "-m", "sh", "-c", script, WS_SERVER], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["echo"].startswith("hello from"), out
    assert out["host"] == f"8765-{out['id']}.{DOMAIN}", out
    assert out["status"] == "HTTP/1.1 101 Switching Protocols" and out["accept_ok"], out
    assert out["frame"] == "ping over wss", out


@pytest.mark.parametrize("args, says", [
    (["--tls-self-signed"], "--domain"),
    (["--tls-cert", "/etc/hostname"], "--tls-key"),
    (["--domain", "Bad_Domain"], "is not a DNS name"),
    (["--domain", DOMAIN, "--tls-cert", "/etc/hostname", "--tls-key", "/etc/hostname"], "/etc/hostname holds no PEM certificate"),
    (["--domain", DOMAIN, "--tls-cert", "/nonexistent.pem", "--tls-key", "/etc/hostname"], "cannot read /nonexistent.pem"),
])
def test_bad_domain_and_tls_flags_are_one_line_errors(args, says):
    r = subprocess.run([os.environ["CORDON_BIN"], "serve", "--listen", "127.0.0.1:0", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
