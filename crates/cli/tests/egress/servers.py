"""The egress tests' "internet": HTTP, HTTPS, DNS and a UDP sink, run inside a network
namespace the test made. Every request and datagram is appended to LOG, so a test can prove
what did and did not arrive.

usage: servers.py DIR IFACE   (DIR holds cert.pem, key.pem, zone.json; LOG is DIR/log)

cert.pem is whatever the caller made: testnet.rs signs it with its own test CA (DIR/ca.pem).

Paths every host answers, on HTTP and HTTPS, for any method (GET, POST, PUT, PATCH, DELETE), with
HTTP/1.1 keep-alive (every response has a Content-Length):
  /echo           200, application/json: {"host", "path", "method", "scheme" ("http" or "https"),
                  "sni" (the TLS server name the client sent, or null), "version", "headers"
                  (every request header as [name, value], in order, duplicates kept),
                  "body_len", "body_sha256", "local", "peer"}; also logged as "echo {json}".
  /redirect?to=U  302 with Location: U.
  /big[/N]        N bytes (64 MiB without N).
anything else     "reached ADDR via SCHEME host=HOST" (or a static site, below).
Each request is logged as "SCHEME ADDR host=HOST path=PATH from=PEER"; a failed TLS handshake as
"tls-failed ADDR sni=NAME from=PEER REASON", a TLS connection closed after the handshake without a
request (curl refusing the name, say) as "tls-closed ADDR sni=NAME from=PEER before any request".

Requests for a name that has a directory under DIR/www are served as static files from it:
a PEP 503 package index (pypi.test, whose wheel lives on files.pypi.test, as pypi.org's live
on *.pythonhosted.org) and a git repository for git's "dumb" HTTP protocol (git.test). Both are
built here at start, without network; the module's value is in DIR/www/pkg-value.

While DIR/capture exists, every frame arriving on IFACE is logged too: "pkt ..." for anything a
sandbox could have sent, "link ..." for the host kernel's own link upkeep (ARP, IPv6 neighbour
discovery and listener reports). A capture, for proving that nothing arrived.
"""
import base64
import hashlib
import http.server
import json
import os
import socket
import socketserver
import ssl
import struct
import subprocess
import sys
import threading
import urllib.parse
import zipfile

DIR = sys.argv[1]
LOG = os.path.join(DIR, "log")
ZONE = json.load(open(os.path.join(DIR, "zone.json")))
WWW = os.path.join(DIR, "www")
BIG = b"x" * (64 * 1024 * 1024)
PKG = "tinypkg"
lock = threading.Lock()


def log(line):
    with lock, open(LOG, "a") as f:
        f.write(line + "\n")


class Handler(http.server.BaseHTTPRequestHandler):
    # Keep-alive: every response below sends a Content-Length (send_error closes).
    protocol_version = "HTTP/1.1"
    # As real servers: a response's head and body are written apart, and on a kept-alive
    # connection the body would otherwise wait for the client's delayed ACK (~40 ms).
    disable_nagle_algorithm = True

    def handle(self):
        # HTTPS: the handshake first, so that a failed one is one line in the log and never a
        # request. A client that checks the name itself after the handshake (curl) just closes:
        # that is logged too.
        self.requests = 0
        if not isinstance(self.connection, ssl.SSLSocket):
            return super().handle()
        local = self.connection.getsockname()[0].removeprefix("::ffff:")
        peer = self.client_address[0]
        try:
            self.connection.do_handshake()
        except (ssl.SSLError, OSError) as e:
            sni = getattr(self.connection, "sni", None)
            log(f"tls-failed {local} sni={sni} from={peer} {getattr(e, 'reason', None) or e}")
            return
        super().handle()
        if self.requests == 0:
            log(f"tls-closed {local} sni={getattr(self.connection, 'sni', None)} from={peer} before any request")

    def parse_request(self):
        self.requests += 1
        return super().parse_request()

    def read_body(self):
        """The request's body (Content-Length or chunked), read whole so that the next request
        on a kept-alive connection starts where it should."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return body
                body += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n > 0 else b""

    def reply(self, status, body, headers=()):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        body = self.read_body()
        local = self.connection.getsockname()[0].removeprefix("::ffff:")
        scheme = "https" if isinstance(self.connection, ssl.SSLSocket) else "http"
        host = self.headers.get("Host", "")
        log(f"{scheme} {local} host={host} path={self.path} from={self.client_address[0]}")
        name = host.split(":")[0].lower()
        route = self.path.split("?")[0]
        if route == "/echo":
            echo = {
                "host": self.headers.get("Host"),
                "path": self.path,
                "method": self.command,
                "scheme": scheme,
                "sni": getattr(self.connection, "sni", None),
                "version": self.request_version,
                "headers": [[k, v] for k, v in self.headers.items()],
                "body_len": len(body),
                "body_sha256": hashlib.sha256(body).hexdigest(),
                "local": local,
                "peer": self.client_address[0].removeprefix("::ffff:"),
            }
            line = json.dumps(echo)
            log(f"echo {line}")
            return self.reply(200, line.encode() + b"\n", [("Content-Type", "application/json")])
        if route == "/redirect":
            to = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get("to", [""])[0]
            return self.reply(302, b"", [("Location", to)])
        if name in os.listdir(WWW):
            return self.static(os.path.join(WWW, name))
        if self.path.startswith("/big"):
            n = int(self.path.split("/")[-1]) if self.path.count("/") > 1 else len(BIG)
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            view = memoryview(BIG)
            while n > 0:
                k = min(n, len(BIG))
                self.wfile.write(view[:k])
                n -= k
            return
        body = f"reached {local} via {scheme} host={host}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def static(self, site):
        path = os.path.normpath(self.path.split("?")[0]).lstrip("/")
        file = os.path.join(site, path)
        if os.path.isdir(file):
            file = os.path.join(file, "index.html")
        if path.startswith("..") or not os.path.isfile(file):
            self.send_error(404)
            return
        data = open(file, "rb").read()
        self.send_response(200)
        # pip accepts an index page only with an HTML content type.
        self.send_header("Content-Type", "text/html" if file.endswith(".html") else "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def log_message(self, *a):
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    address_family = socket.AF_INET6

    def server_bind(self):
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def dns_answer(q):
    tid, flags, qd = struct.unpack("!HHH", q[:6])
    i, labels = 12, []
    while q[i]:
        labels.append(q[i + 1 : i + 1 + q[i]].decode())
        i += 1 + q[i]
    qtype, _ = struct.unpack("!HH", q[i + 1 : i + 5])
    question = q[12 : i + 5]
    name = ".".join(labels).lower()
    log(f"dns {name} type={qtype}")
    recs = ZONE.get(name)
    if recs is None:
        return struct.pack("!HHHHHH", tid, 0x8183, 1, 0, 0, 0) + question
    answers = b""
    count = 0
    for addr in recs:
        fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
        if (qtype == 1 and fam == socket.AF_INET) or (qtype == 28 and fam == socket.AF_INET6):
            raw = socket.inet_pton(fam, addr)
            answers += struct.pack("!HHHLH", 0xC00C, qtype, 1, 5, len(raw)) + raw
            count += 1
    return struct.pack("!HHHHHH", tid, 0x8180, 1, count, 0, 0) + question + answers


def dns_udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", 53))
    while True:
        q, peer = s.recvfrom(4096)
        try:
            s.sendto(dns_answer(q), peer)
        except Exception as e:  # a malformed query is the sender's problem
            log(f"dns error {e}")


def dns_tcp():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 53))
    s.listen(16)
    while True:
        c, _ = s.accept()
        try:
            n = struct.unpack("!H", c.recv(2))[0]
            a = dns_answer(c.recv(n))
            c.sendall(struct.pack("!H", len(a)) + a)
        except Exception as e:
            log(f"dns error {e}")
        c.close()


def udp_sink():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", 9999))
    while True:
        data, peer = s.recvfrom(4096)
        log(f"udp from={peer[0]} {data[:40]!r}")


def icmp6_type(ip):
    """The ICMPv6 type of an IPv6 packet (past a hop-by-hop header, which listener reports
    carry), or None."""
    nh, off = ip[6], 40
    if nh == 0 and len(ip) > off + 1:
        nh, off = ip[off], off + (ip[off + 1] + 1) * 8
    return ip[off] if nh == 58 and len(ip) > off else None


def capture():
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    s.bind((sys.argv[2], 0))
    flag = os.path.join(DIR, "capture")
    while True:
        frame, _ = s.recvfrom(65535)
        if not os.path.exists(flag):
            continue
        eth = struct.unpack("!H", frame[12:14])[0]
        ip = frame[14:]
        if eth == 0x0800:
            log(f"pkt v4 {socket.inet_ntop(socket.AF_INET, ip[12:16])} > {socket.inet_ntop(socket.AF_INET, ip[16:20])} proto={ip[9]}")
        elif eth == 0x86DD and icmp6_type(ip) in (130, 131, 132, 133, 134, 135, 136, 137, 143):
            # Neighbour discovery and multicast listener reports: the host kernel's own upkeep
            # of the link, never a sandbox's (a sandbox has no link to this network).
            log(f"link v6 icmp6 type={icmp6_type(ip)}")
        elif eth == 0x86DD:
            log(f"pkt v6 {socket.inet_ntop(socket.AF_INET6, ip[8:24])} > {socket.inet_ntop(socket.AF_INET6, ip[24:40])} proto={ip[6]}")
        elif eth == 0x0806:
            log("link arp")
        else:
            log(f"pkt eth=0x{eth:04x}")


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def make_index():
    """A wheel (a zip with the module and METADATA, WHEEL and RECORD) on files.pypi.test and
    the PEP 503 pages on pypi.test that link to it."""
    value = f"{PKG} from the test index {os.urandom(6).hex()}"
    dist = f"{PKG}-1.0.dist-info"
    files = {
        f"{PKG}/__init__.py": f"VALUE = {value!r}\n".encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {PKG}\nVersion: 1.0\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: servers.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    files[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    wheel = f"{PKG}-1.0-py3-none-any.whl"
    path = os.path.join(WWW, "files.pypi.test", "packages", wheel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    link = f"https://files.pypi.test/packages/{wheel}#sha256={sha}"
    page = lambda body: f"<!DOCTYPE html><html><body>{body}</body></html>\n".encode()
    write(os.path.join(WWW, "pypi.test", "simple", "index.html"), page(f'<a href="/simple/{PKG}/">{PKG}</a>'))
    write(os.path.join(WWW, "pypi.test", "simple", PKG, "index.html"), page(f'<a href="{link}">{wheel}</a>'))
    write(os.path.join(WWW, "pkg-value"), value.encode())


def make_repo():
    """A bare repository with one commit, readable over git's dumb HTTP protocol (static files
    plus the info/refs and objects/info/packs that `git update-server-info` writes)."""
    env = dict(os.environ, GIT_CONFIG_GLOBAL="/dev/null", GIT_CONFIG_NOSYSTEM="1", GIT_AUTHOR_NAME="test",
               GIT_AUTHOR_EMAIL="test@git.test", GIT_COMMITTER_NAME="test", GIT_COMMITTER_EMAIL="test@git.test")
    work = os.path.join(DIR, "repo-work")
    bare = os.path.join(WWW, "git.test", "repo.git")
    git = lambda *a: subprocess.run(["git", *a], env=env, check=True, capture_output=True)
    git("init", "-q", "-b", "main", work)
    write(os.path.join(work, "README"), b"served by the egress tests' git host\n")
    git("-C", work, "add", "README")
    git("-C", work, "commit", "-q", "-m", "the commit the test internet made")
    git("clone", "-q", "--bare", work, bare)
    git("-C", bare, "update-server-info")


def main():
    make_index()
    make_repo()
    http_srv = Server(("::", 80), Handler)
    https_srv = Server(("::", 443), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(os.path.join(DIR, "cert.pem"), os.path.join(DIR, "key.pem"))

    # The name the client asked for (None without SNI), for /echo; one certificate for all.
    def sni(sock, name, _ctx):
        sock.sni = name

    ctx.sni_callback = sni
    # The handshake happens in the request's thread, on its first read: a client that stalls
    # or fails it (a name mismatch on badcert.test, say) holds up no one else.
    https_srv.socket = ctx.wrap_socket(https_srv.socket, server_side=True, do_handshake_on_connect=False)
    for target in (http_srv.serve_forever, https_srv.serve_forever, dns_udp, dns_tcp, udp_sink, capture):
        threading.Thread(target=target, daemon=True).start()
    open(os.path.join(DIR, "ready"), "w").close()
    threading.Event().wait()


main()
