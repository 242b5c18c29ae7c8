#!/usr/bin/env python3
"""A real local OCI registry for the image tests (crates/cli/tests/images.rs). Python stdlib only;
it drives Debian's umoci, skopeo, docker-registry (distribution v2), busybox-static and openssl.

  registry.py build-images OUT_DIR
      Builds small busybox images with umoci into the OCI layout OUT_DIR/oci, exports `bb` as
      OUT_DIR/bb-docker.tar (docker save), OUT_DIR/bb-oci (OCI layout dir), OUT_DIR/bb-oci.tar
      (OCI layout tar) and OUT_DIR/bb-rootfs.tar (a flat rootfs), and writes OUT_DIR/images.json
      (what each image is made of: layer digests, diff_ids, sizes). Prints that JSON.

  registry.py serve --dir DIR [--images OUT_DIR] [--token-auth] [--die-after BYTES] [--stop-on-eof]
      Runs /usr/bin/docker-registry on 127.0.0.1 (a free port; config and storage in DIR), pushes
      the images (built into DIR/images unless --images names a build), then prints one JSON line
      {"registry": "127.0.0.1:PORT", "proxy": "127.0.0.1:PORT2", ...} and stays in the foreground
      until SIGTERM/SIGINT (which stops the registry too; the registry also dies with us).
      --token-auth: the registry uses bearer-token auth; a token server here issues RS256 JWTs
        (x5c header, the self-signed certificate is the registry's rootcertbundle) to alice:s3cret
        only; anything else gets 401.
      --stop-on-eof: also stop when stdin reaches its end (a test binary holds the pipe).
      The proxy ("proxy") forwards to the registry and, for repository `weird`, answers manifests
      itself with an unknown media type. --die-after BYTES: the proxy cuts every blob response
      (GET /v2/*/blobs/*) after BYTES bytes of body by closing the connection ("dying").

  registry.py corrupt --dir DIR --image NAME [--tag TAG] [--layer N]
      Flips a byte in layer N (default 0, the bottom one) of NAME:TAG in the registry's storage, so
      the registry serves bytes that do not match their digest. For a gzip blob the byte is in the
      gzip header's MTIME: it still decompresses to the same tar (the diff_id matches), only the
      blob digest is wrong. Prints {"digest": ..., "diff_id": ..., "path": ...}.
"""

import argparse
import base64
import ctypes
import gzip
import hashlib
import http.client
import http.server
import io
import json
import os
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.parse
import urllib.request

BUSYBOX = "/bin/busybox"
USER, PASSWORD = "alice", "s3cret"
SERVICE, ISSUER = "cordon-test-registry", "cordon-test-token-issuer"
# The images `serve` pushes: (source ref in the OCI layout, destination repo:tag, extra skopeo flags).
# `--preserve-digests` everywhere: skopeo must neither recompress nor swap in a blob it knows
# the registry has for the same diff_id (its blob-info cache would turn bbzstd's layers into bb's
# gzip ones).
PUSHES = [
    ("oci", "bb", "bb:latest", []),
    ("oci", "bb", "bb:v1", []),
    ("oci", "bbplus", "bbplus:latest", []),
    ("oci", "noshell", "noshell:latest", []),
    ("oci", "multi", "multi:latest", ["--all"]),
    ("zstd", "bbzstd", "bbzstd:latest", []),
]
MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_UNKNOWN = "application/vnd.example.unknown.v1+json"


def log(*a):
    print("registry.py:", *a, file=sys.stderr, flush=True)


def run(*cmd, **kw):
    """Runs a command; on failure raises with its output."""
    r = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    if r.returncode != 0:
        raise SystemExit(f"registry.py: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return r.stdout


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# build-images


class Layout:
    """An OCI layout driven with umoci."""

    def __init__(self, path):
        self.path = path
        self.rootless = ["--rootless"] if os.geteuid() != 0 else []

    def ref(self, tag):
        return f"{self.path}:{tag}"

    def init(self):
        run("umoci", "init", "--layout", self.path)

    def new(self, tag):
        run("umoci", "new", "--image", self.ref(tag))

    def layer(self, tag, work, change, comment):
        """Unpacks `tag`, lets `change(rootfs)` modify it and repacks it as one new layer."""
        bundle = os.path.join(work, f"bundle-{tag}-{time.monotonic_ns()}")
        run("umoci", "unpack", *self.rootless, "--image", self.ref(tag), bundle)
        change(os.path.join(bundle, "rootfs"))
        run("umoci", "repack", "--history.created_by", comment, "--image", self.ref(tag), bundle)
        shutil.rmtree(bundle)

    def add_layer(self, tag, tar_path, comment):
        run("umoci", "raw", "add-layer", "--history.created_by", comment, "--image", self.ref(tag), tar_path)

    def config(self, tag, *flags):
        run("umoci", "config", "--image", self.ref(tag), *flags)

    def blob(self, digest):
        return os.path.join(self.path, "blobs", *digest.split(":", 1))

    def read_json(self, digest):
        with open(self.blob(digest)) as f:
            return json.load(f)

    def index(self):
        with open(os.path.join(self.path, "index.json")) as f:
            return json.load(f)

    def descriptor(self, tag):
        for m in self.index()["manifests"]:
            if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag:
                return m
        raise SystemExit(f"registry.py: no {tag} in {self.path}")

    def write_blob(self, data):
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        with open(self.blob(digest), "wb") as f:
            f.write(data)
        return digest

    def describe(self, tag):
        """What the tests need to know of one image manifest."""
        d = self.descriptor(tag)
        m = self.read_json(d["digest"])
        cfg = self.read_json(m["config"]["digest"])
        return {
            "manifest": d["digest"],
            "config": m["config"]["digest"],
            "layers": [{"digest": l["digest"], "size": l["size"], "media_type": l["mediaType"]} for l in m["layers"]],
            "diff_ids": cfg["rootfs"]["diff_ids"],
            "architecture": cfg.get("architecture"),
            "config_json": cfg.get("config", {}),
        }


def write(path, text, mode=0o644, uid=0, gid=0):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    if os.geteuid() == 0:
        os.chown(path, uid, gid)


def dirs(root, *names, mode=0o755):
    for n in names:
        p = os.path.join(root, n)
        os.makedirs(p, exist_ok=True)
        os.chmod(p, mode)


def etc(root, users):
    """/etc/passwd and /etc/group with root and `users` [(name, uid, home)]."""
    passwd = "root:x:0:0:root:/root:/bin/sh\n" + "".join(f"{n}:x:{u}:{u}:{n}:{h}:/bin/sh\n" for n, u, h in users)
    group = "root:x:0:\n" + "".join(f"{n}:x:{u}:\n" for n, u, _ in users)
    write(os.path.join(root, "etc/passwd"), passwd)
    write(os.path.join(root, "etc/group"), group)
    write(os.path.join(root, "etc/hostname"), "bb\n")


def skeleton(root):
    dirs(root, "bin", "etc", "dev", "proc", "sys", "root", "home", "usr", "var")
    dirs(root, "tmp", mode=0o1777)


def install_busybox(root, name="busybox", applets=True):
    dst = os.path.join(root, "bin", name)
    shutil.copy(BUSYBOX, dst)
    os.chmod(dst, 0o755)
    if applets:
        for a in run(BUSYBOX, "--list").split():
            link = os.path.join(root, "bin", a)
            if a != name and not os.path.lexists(link):
                os.symlink(name, link)


def opaque_layer_tar(path):
    """A layer that makes /opq opaque (`.wh..wh..opq`) and puts c.txt in it. umoci writes one
    `.wh.NAME` per deleted file and never an opaque whiteout, so this layer is made by hand."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        def add(name, kind, data=b"", mode=0o644):
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode, ti.mtime, ti.uid, ti.gid = kind, mode, 1700000000, 0, 0
            ti.size = len(data) if kind == tarfile.REGTYPE else 0
            t.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("opq", tarfile.DIRTYPE, mode=0o755)
        add("opq/.wh..wh..opq", tarfile.REGTYPE)
        add("opq/c.txt", tarfile.REGTYPE, b"new content\n")


def layer_names(lay, digest):
    with gzip.open(lay.blob(digest)) as g, tarfile.open(fileobj=g, mode="r|") as t:
        return [m.name for m in t]


def is_static(path):
    """No PT_INTERP program header: the ELF needs no dynamic loader (no libc in these images)."""
    import struct
    with open(path, "rb") as f:
        h = f.read(64)
        if h[:4] != b"\x7fELF" or h[4] != 2:
            return False
        phoff, = struct.unpack_from("<Q", h, 32)
        phentsize, phnum = struct.unpack_from("<HH", h, 54)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            if struct.unpack("<I", f.read(4))[0] == 3:  # PT_INTERP
                return False
    return True


def build_images(out):
    if not os.path.exists(BUSYBOX) or not is_static(BUSYBOX):
        raise SystemExit(f"registry.py: {BUSYBOX} is missing or not static: apt-get install busybox-static")
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="work-", dir=out)
    oci = os.path.join(out, "oci")
    if os.path.exists(oci):
        shutil.rmtree(oci)
    lay = Layout(oci)
    lay.init()

    # bb: 3 layers. 1: etc, directories and the files later layers delete or hide (small);
    # 2: busybox with its applets, and /old/gone.txt deleted (a `.wh.gone.txt`); 3: /opq made
    # opaque with only c.txt in it. The big layer is in the middle, so a pull cut in its blobs
    # can have completed the two small ones.
    lay.new("bb")

    def bb1(r):
        skeleton(r)
        etc(r, [("app", 1234, "/home/app")])
        dirs(r, "home/app", "work", "old", "opq")
        if os.geteuid() == 0:
            os.chown(os.path.join(r, "home/app"), 1234, 1234)
            os.chown(os.path.join(r, "work"), 1234, 1234)
        write(os.path.join(r, "old/gone.txt"), "deleted by layer 2\n")
        write(os.path.join(r, "old/keep.txt"), "kept\n")
        write(os.path.join(r, "opq/a.txt"), "hidden by layer 3\n")
        write(os.path.join(r, "opq/b.txt"), "hidden by layer 3\n")
        write(os.path.join(r, "work/hello.txt"), "hello from /work\n", uid=1234, gid=1234)

    def bb2(r):
        install_busybox(r)
        os.unlink(os.path.join(r, "old/gone.txt"))

    lay.layer("bb", work, bb1, "bb layer 1: etc and files")
    lay.layer("bb", work, bb2, "bb layer 2: busybox, rm /old/gone.txt")
    opq_tar = os.path.join(work, "opq.tar")
    opaque_layer_tar(opq_tar)
    lay.add_layer("bb", opq_tar, "bb layer 3: /opq opaque")
    lay.config(
        "bb",
        "--config.env", "PATH=/bin",
        "--config.env", "GREETING=hello",
        "--config.workingdir", "/work",
        "--config.user", "app",
        "--config.entrypoint", "/bin/busybox",
        "--config.cmd", "echo",
        "--config.cmd", "hello from bb",
        "--architecture", "amd64",
        "--os", "linux",
    )

    # bbplus: bb and one layer more (/plus.txt): it shares bb's three layers and has one of its own.
    run("umoci", "tag", "--image", lay.ref("bb"), "bbplus")

    def plus(r):
        write(os.path.join(r, "plus.txt"), "only in bbplus\n")

    lay.layer("bbplus", work, plus, "bbplus: /plus.txt")

    # noshell: busybox only as /bin/busybox-ns (busybox runs applets named by argv[1] only when
    # argv[0] starts with "busybox"), no /bin/sh and no applet links.
    lay.new("noshell")

    def ns1(r):
        skeleton(r)
        etc(r, [])
        install_busybox(r, "busybox-ns", applets=False)

    lay.layer("noshell", work, ns1, "noshell: busybox-ns only")
    lay.config("noshell", "--config.env", "PATH=/bin", "--config.cmd", "/bin/busybox-ns", "--config.cmd", "echo", "--config.cmd", "hi")

    # multi: an index of linux/arm64 (listed first, so a client that takes the first entry gets
    # the wrong one) and linux/amd64; /arch says which.
    for arch in ["amd64", "arm64"]:
        tag = f"multi-{arch}"
        lay.new(tag)

        def m1(r, arch=arch):
            skeleton(r)
            etc(r, [])
            install_busybox(r)
            write(os.path.join(r, "arch"), arch + "\n")
            if arch == "arm64":
                write(os.path.join(r, "only-arm64"), "x\n")

        lay.layer(tag, work, m1, f"multi {arch}")
        lay.config(tag, "--config.env", "PATH=/bin", "--architecture", arch, "--os", "linux")
    entries = []
    for arch in ["arm64", "amd64"]:
        d = dict(lay.descriptor(f"multi-{arch}"))
        d.pop("annotations", None)
        d["platform"] = {"architecture": arch, "os": "linux", **({"variant": "v8"} if arch == "arm64" else {})}
        entries.append(d)
    index_blob = json.dumps({"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": entries}).encode()
    index_digest = lay.write_blob(index_blob)
    idx = lay.index()
    idx["manifests"].append(
        {"mediaType": MT_INDEX, "digest": index_digest, "size": len(index_blob), "annotations": {"org.opencontainers.image.ref.name": "multi"}}
    )
    with open(os.path.join(oci, "index.json"), "w") as f:
        json.dump(idx, f)
    run("umoci", "gc", "--layout", oci)

    # The whiteouts really are in the layers.
    bb = lay.describe("bb")
    l2, l3 = layer_names(lay, bb["layers"][1]["digest"]), layer_names(lay, bb["layers"][2]["digest"])
    assert "old/.wh.gone.txt" in l2, l2[:20]
    assert "opq/.wh..wh..opq" in l3 and "opq/c.txt" in l3, l3

    # bb as `docker save`, OCI layout dir, OCI layout tar and plain rootfs tar.
    for p in ["bb-docker.tar", "bb-oci.tar", "bb-rootfs.tar"]:
        if os.path.exists(os.path.join(out, p)):
            os.unlink(os.path.join(out, p))
    if os.path.exists(os.path.join(out, "bb-oci")):
        shutil.rmtree(os.path.join(out, "bb-oci"))
    src = f"oci:{oci}:bb"
    # bb with zstd layers, in a layout of its own (skopeo reuses a layout's gzip blobs otherwise).
    zstd = os.path.join(out, "zstd")
    if os.path.exists(zstd):
        shutil.rmtree(zstd)
    run("skopeo", "--insecure-policy", "copy", "-q", "--dest-compress-format", "zstd", src, f"oci:{zstd}:bbzstd")
    bbzstd = Layout(zstd).describe("bbzstd")
    assert all(l["media_type"].endswith("+zstd") for l in bbzstd["layers"]), bbzstd
    assert bbzstd["diff_ids"] == bb["diff_ids"]
    run("skopeo", "--insecure-policy", "copy", "-q", src, f"docker-archive:{out}/bb-docker.tar:bb:latest")
    run("skopeo", "--insecure-policy", "copy", "-q", src, f"oci:{out}/bb-oci:latest")
    run("skopeo", "--insecure-policy", "copy", "-q", src, f"oci-archive:{out}/bb-oci.tar:latest")
    flat = os.path.join(work, "flat")
    run("umoci", "unpack", *lay.rootless, "--image", lay.ref("bb"), flat)
    run("tar", "-C", os.path.join(flat, "rootfs"), "--numeric-owner", "-cf", os.path.join(out, "bb-rootfs.tar"), ".")
    shutil.rmtree(work)

    info = {
        "oci": oci,
        "zstd": zstd,
        "bb": bb,
        "bbzstd": bbzstd,
        "bbplus": lay.describe("bbplus"),
        "noshell": lay.describe("noshell"),
        "multi": {"index": index_digest, "amd64": lay.describe("multi-amd64"), "arm64": lay.describe("multi-arm64")},
        "docker_archive": os.path.join(out, "bb-docker.tar"),
        "oci_dir": os.path.join(out, "bb-oci"),
        "oci_tar": os.path.join(out, "bb-oci.tar"),
        "rootfs_tar": os.path.join(out, "bb-rootfs.tar"),
    }
    with open(os.path.join(out, "images.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


# ---------------------------------------------------------------------------------------------
# token server


def b64url(b):
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


class Tokens:
    def __init__(self, d):
        self.key, self.cert = os.path.join(d, "token.key"), os.path.join(d, "token.crt")
        run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", self.key, "-out", self.cert,
            "-days", "3", "-subj", "/CN=cordon test token issuer")
        der = subprocess.run(["openssl", "x509", "-in", self.cert, "-outform", "DER"], stdout=subprocess.PIPE, check=True).stdout
        self.x5c = base64.b64encode(der).decode()
        self.lock = threading.Lock()
        self.issued = 0

    def sign(self, subject, access):
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {"iss": ISSUER, "sub": subject, "aud": SERVICE, "exp": now + 600, "nbf": now - 10, "iat": now,
                  "jti": os.urandom(8).hex(), "access": access}
        signing_input = b64url(json.dumps(header).encode()) + "." + b64url(json.dumps(claims).encode())
        sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", self.key], input=signing_input.encode(),
                             stdout=subprocess.PIPE, check=True).stdout
        with self.lock:
            self.issued += 1
        return signing_input + "." + b64url(sig)


def parse_scopes(scopes):
    """`repository:bb:pull,push` -> {"type", "name", "actions"} (the granted actions)."""
    out = []
    for s in scopes:
        for one in s.split(" "):
            parts = one.split(":")
            if len(parts) < 3:
                continue
            typ, name, actions = parts[0], ":".join(parts[1:-1]), parts[-1].split(",")
            out.append({"type": typ, "name": name, "actions": actions})
    return out


def token_handler(tokens):
    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):
            pass

        def creds_ok(self, user, password):
            return user == USER and password == PASSWORD

        def reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if code == 401:
                self.send_header("WWW-Authenticate", 'Basic realm="cordon test token server"')
            self.end_headers()
            self.wfile.write(data)

        def grant(self, user, password, scopes, service):
            if not self.creds_ok(user, password):
                return self.reply(401, {"errors": [{"code": "UNAUTHORIZED", "message": "wrong or missing credentials"}]})
            if service and service != SERVICE:
                return self.reply(400, {"errors": [{"code": "DENIED", "message": f"unknown service {service}"}]})
            tok = tokens.sign(user, parse_scopes(scopes))
            self.reply(200, {"token": tok, "access_token": tok, "expires_in": 600,
                             "issued_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})

        def do_GET(self):
            u = urllib.parse.urlsplit(self.path)
            q = urllib.parse.parse_qs(u.query)
            user = password = None
            h = self.headers.get("Authorization", "")
            if h.lower().startswith("basic "):
                try:
                    user, _, password = base64.b64decode(h[6:].strip()).decode().partition(":")
                except Exception:
                    pass
            self.grant(user, password, q.get("scope", []), (q.get("service") or [""])[0])

        def do_POST(self):
            # OAuth2 password grant (docker's `POST /token` form).
            n = int(self.headers.get("Content-Length") or 0)
            q = urllib.parse.parse_qs(self.rfile.read(n).decode())
            if (q.get("grant_type") or [""])[0] != "password":
                return self.reply(400, {"error": "unsupported_grant_type"})
            self.grant((q.get("username") or [""])[0], (q.get("password") or [""])[0], q.get("scope", []),
                       (q.get("service") or [""])[0])

    return H


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def start_http(handler):
    srv = Server(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


# ---------------------------------------------------------------------------------------------
# proxy


HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


def proxy_handler(upstream, die_after, stats):
    host, port = upstream.rsplit(":", 1)
    stats_lock = threading.Lock()

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):
            pass

        def weird(self):
            body = json.dumps({"schemaVersion": 2, "mediaType": MT_UNKNOWN, "payload": "not an image"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", MT_UNKNOWN)
            self.send_header("Docker-Content-Digest", "sha256:" + hashlib.sha256(body).hexdigest())
            self.send_header("Docker-Distribution-Api-Version", "registry/2.0")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def forward(self):
            path = urllib.parse.urlsplit(self.path).path
            if path.startswith("/v2/weird/manifests/"):
                return self.weird()
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else None
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            try:
                # Header by header: a client sends Accept several times (one per manifest type).
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in HOP and k.lower() != "content-length":
                        conn.putheader(k, v)
                if body is not None:
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body)
                resp = conn.getresponse()
                blob = self.command == "GET" and "/blobs/" in path and resp.status == 200
                self.send_response(resp.status, resp.reason)
                length = resp.getheader("Content-Length")
                for k, v in resp.getheaders():
                    if k.lower() not in HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                if self.command == "HEAD":
                    if length is not None:
                        self.send_header("Content-Length", length)
                    self.end_headers()
                    return
                if blob and die_after is not None:
                    # The full length is announced; only the first `die_after` bytes follow.
                    if length is not None:
                        self.send_header("Content-Length", length)
                    self.end_headers()
                    left = die_after
                    while left > 0:
                        chunk = resp.read(min(left, 65536))
                        if not chunk:
                            break
                        self.wfile.write(chunk)
                        left -= len(chunk)
                    self.wfile.flush()
                    with stats_lock:
                        stats["cut"] += 1
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                data = resp.read()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            finally:
                conn.close()

        do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = forward

    return H


# ---------------------------------------------------------------------------------------------
# serve


REGISTRY_CONFIG = """version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:{port}
  secret: cordon-test-{secret}
  draintimeout: 1s
{auth}"""

TOKEN_AUTH = """auth:
  token:
    realm: {realm}
    service: {service}
    issuer: {issuer}
    rootcertbundle: {cert}
"""


def set_pdeathsig():
    """The registry dies with us even when we are SIGKILLed."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def wait_ready(addr, proc, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        try:
            c = http.client.HTTPConnection(*addr.rsplit(":", 1), timeout=2)
            c.request("GET", "/v2/")
            r = c.getresponse()
            r.read()
            c.close()
            if r.status in (200, 401):
                return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def serve(a):
    d = os.path.abspath(a.dir)
    os.makedirs(d, exist_ok=True)
    images = os.path.abspath(a.images) if a.images else os.path.join(d, "images")
    if not os.path.exists(os.path.join(images, "images.json")):
        build_images(images)
    with open(os.path.join(images, "images.json")) as f:
        info = json.load(f)
    storage = os.path.join(d, "storage")
    os.makedirs(storage, exist_ok=True)

    auth = ""
    token_srv = None
    if a.token_auth:
        tokens = Tokens(d)
        token_srv = start_http(token_handler(tokens))
        realm = f"http://127.0.0.1:{token_srv.server_address[1]}/token"
        auth = TOKEN_AUTH.format(realm=realm, service=SERVICE, issuer=ISSUER, cert=tokens.cert)

    children = []

    def stop(*_):
        for c in children:
            if c.poll() is None:
                c.terminate()
        for c in children:
            try:
                c.wait(5)
            except subprocess.TimeoutExpired:
                c.kill()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    for attempt in range(5):
        port = free_port()
        cfg = os.path.join(d, "config.yml")
        with open(cfg, "w") as f:
            f.write(REGISTRY_CONFIG.format(storage=storage, port=port, secret=os.urandom(8).hex(), auth=auth))
        logf = open(os.path.join(d, "registry.log"), "ab")
        proc = subprocess.Popen(["/usr/bin/docker-registry", "serve", cfg], stdout=logf, stderr=logf,
                                stdin=subprocess.DEVNULL, preexec_fn=set_pdeathsig)
        children.append(proc)
        addr = f"127.0.0.1:{port}"
        if wait_ready(addr, proc):
            break
        proc.kill()
        proc.wait()
        children.remove(proc)
    else:
        with open(os.path.join(d, "registry.log"), errors="replace") as f:
            raise SystemExit("registry.py: docker-registry did not start:\n" + f.read()[-4000:])

    creds = ["--dest-creds", f"{USER}:{PASSWORD}"] if a.token_auth else []
    for layout, src, dst, flags in PUSHES:
        run("skopeo", "--insecure-policy", "copy", "-q", "--preserve-digests", "--retry-times", "2", "--dest-tls-verify=false",
            *creds, *flags, f"oci:{info[layout]}:{src}", f"docker://{addr}/{dst}")
    # The zstd copy really is zstd.
    zm = registry_manifest(storage, "bbzstd", "latest")
    assert all(l["mediaType"].endswith("+zstd") for l in zm["layers"]), zm

    stats = {"cut": 0}
    proxy = start_http(proxy_handler(addr, a.die_after, stats))
    proxy_addr = f"127.0.0.1:{proxy.server_address[1]}"
    out = {"registry": addr, "proxy": proxy_addr, "dir": d, "images": images, "log": os.path.join(d, "registry.log"),
           "pid": os.getpid()}
    if a.die_after is not None:
        out["dying"] = proxy_addr
        out["die_after"] = a.die_after
    if a.token_auth:
        out.update({"token_realm": realm, "user": USER, "password": PASSWORD, "service": SERVICE})
    print(json.dumps(out), flush=True)
    if a.stop_on_eof:
        # The caller holds our stdin open for as long as it wants us; its exit closes it.
        threading.Thread(target=lambda: (sys.stdin.buffer.read(), stop()), daemon=True).start()
    while True:
        if proc.poll() is not None:
            log(f"docker-registry exited with {proc.returncode}")
            stop()
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# corrupt


def v2(storage):
    return os.path.join(storage, "docker", "registry", "v2")


def storage_blob(storage, digest):
    algo, hexd = digest.split(":", 1)
    return os.path.join(v2(storage), "blobs", algo, hexd[:2], hexd, "data")


def registry_manifest(storage, repo, tag):
    link = os.path.join(v2(storage), "repositories", repo, "_manifests", "tags", tag, "current", "link")
    with open(link) as f:
        digest = f.read().strip()
    with open(storage_blob(storage, digest)) as f:
        return json.load(f)


def corrupt(a):
    storage = os.path.join(os.path.abspath(a.dir), "storage")
    m = registry_manifest(storage, a.image, a.tag)
    if m.get("mediaType") == MT_INDEX or "manifests" in m:
        raise SystemExit("registry.py: corrupt wants a single-image manifest, not an index")
    layer = m["layers"][a.layer]
    with open(storage_blob(storage, m["config"]["digest"])) as f:
        diff_id = json.load(f)["rootfs"]["diff_ids"][a.layer]
    path = storage_blob(storage, layer["digest"])
    with open(path, "r+b") as f:
        data = f.read()
        at = 4 if data[:2] == b"\x1f\x8b" else len(data) // 2
        f.seek(at)
        f.write(bytes([data[at] ^ 0xFF]))
    print(json.dumps({"digest": layer["digest"], "diff_id": diff_id, "path": path, "offset": at}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-images")
    b.add_argument("out")
    s = sub.add_parser("serve")
    s.add_argument("--dir", required=True)
    s.add_argument("--images")
    s.add_argument("--token-auth", action="store_true")
    s.add_argument("--die-after", type=int)
    s.add_argument("--stop-on-eof", action="store_true")
    c = sub.add_parser("corrupt")
    c.add_argument("--dir", required=True)
    c.add_argument("--image", required=True)
    c.add_argument("--tag", default="latest")
    c.add_argument("--layer", type=int, default=0)
    a = p.parse_args()
    if a.cmd == "build-images":
        print(json.dumps(build_images(os.path.abspath(a.out))), flush=True)
    elif a.cmd == "serve":
        serve(a)
    elif a.cmd == "corrupt":
        corrupt(a)


if __name__ == "__main__":
    main()
