"""The client CLI (`cordon ps/exec/shell/cp/kill/audit/logs`): the real binary (CORDON_BIN)
against the suite's `cordon serve`, with sandboxes made by the real `e2b` SDK. The shell runs
under a real PTY made here, whose size, keys and settings the test controls and checks."""

import fcntl
import hashlib
import json
import os
import re
import secrets
import select
import struct
import subprocess
import termios
import time

import httpx
import pytest
from conftest import free_port
from e2b import Sandbox, Template, wait_for_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cordon serve needs root")

BIN = os.environ["CORDON_BIN"]
API_URL = os.environ["E2B_API_URL"]
H = {"X-API-KEY": os.environ["E2B_API_KEY"]}
# A wait for something that takes well under a second here; only a failure waits this long.
PATIENCE = 60


def cordon(*args, input=None, env=None, timeout=PATIENCE * 2):
    return subprocess.run([BIN, *args], input=input, capture_output=True, timeout=timeout, env=env)


def one_line_error(r):
    """What a refused command printed: exactly one line on stderr, nothing on stdout."""
    err = r.stderr.decode()
    assert r.stdout == b"", r
    assert err.count("\n") == 1 and err.startswith("cordon"), err
    return err


def ps_rows(*flags):
    r = cordon("ps", "--json", *flags)
    assert r.returncode == 0, r
    return {row["id"]: row for row in json.loads(r.stdout)}


@pytest.fixture
def sbx():
    s = Sandbox.create(timeout=300)
    try:
        yield s
    finally:
        s.kill()


def test_ps_lists_running_and_paused_sandboxes(sbx):
    paused = Sandbox.create(timeout=300)
    try:
        assert paused.pause()
        rows = ps_rows()
        assert sbx.sandbox_id in rows and paused.sandbox_id not in rows, rows
        row = rows[sbx.sandbox_id]
        assert (row["template"], row["tier"], row["state"], row["network"]) == ("base", "ns", "running", "closed"), row
        assert row["memTotalBytes"] == 512 << 20 and row["memUsedBytes"] > 0 and row["cpuPct"] is not None, row
        rows = ps_rows("--all")
        assert rows[paused.sandbox_id]["state"] == "paused", rows
        table = cordon("ps", "--all")
        assert table.returncode == 0, table
        lines = table.stdout.decode().splitlines()
        assert lines[0].split() == ["ID", "TEMPLATE", "TIER", "STATE", "AGE", "CPU", "MEMORY", "NETWORK"], lines
        mine = [l.split() for l in lines if l.startswith(sbx.sandbox_id)]
        assert mine and mine[0][1:4] == ["base", "ns", "running"] and mine[0][-1] == "closed", lines
    finally:
        paused.kill()


def test_exec_streams_both_outputs_and_returns_the_exit_code(sbx):
    r = cordon("exec", sbx.sandbox_id, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
    assert (r.returncode, r.stdout, r.stderr) == (3, b"out\n", b"err\n"), r
    r = cordon("exec", "-e", "FOO=bar baz", "-w", "/tmp", sbx.sandbox_id, "--", "sh", "-c", 'echo "$FOO"; pwd; whoami')
    assert (r.returncode, r.stdout) == (0, b"bar baz\n/tmp\nuser\n"), r
    r = cordon("exec", "-u", "root", sbx.sandbox_id, "--", "id", "-u")
    assert r.stdout == b"0\n", r
    # Our stdin, when it is not a terminal, is the command's.
    data = os.urandom(100_000)
    r = cordon("exec", sbx.sandbox_id, "--", "sha256sum", input=data)
    assert r.returncode == 0 and r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest(), r
    # A signal: 128+N, as a shell says.
    r = cordon("exec", sbx.sandbox_id, "--", "sh", "-c", "kill -9 $$")
    assert r.returncode == 137, r


def test_exec_output_arrives_while_the_command_runs(sbx):
    go = f"/tmp/go-{secrets.token_hex(4)}"
    p = subprocess.Popen(
        [BIN, "exec", sbx.sandbox_id, "--", "sh", "-c", f"echo first; while [ ! -e {go} ]; do sleep 0.05; done; echo second"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert p.stdout.readline() == b"first\n"
        # The command waits for the file: its first line came while it ran.
        assert p.poll() is None
        sbx.files.write(go, "")
        assert p.stdout.readline() == b"second\n"
        assert p.wait(timeout=PATIENCE) == 0
    finally:
        p.kill()


class Terminal:
    """`cordon shell` on a PTY of ours: its controlling terminal, whose size and keys we set."""

    def __init__(self, sid, rows, cols):
        self.master, self.slave = os.openpty()
        self.resize(rows, cols)
        self.before = termios.tcgetattr(self.slave)
        slave = self.slave

        def controlling_terminal():
            fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            [BIN, "shell", sid],
            stdin=self.slave,
            stdout=self.slave,
            stderr=self.slave,
            start_new_session=True,
            preexec_fn=controlling_terminal,
            env={**os.environ, "TERM": "xterm"},
        )
        self.seen = b""

    def resize(self, rows, cols):
        # The kernel sends SIGWINCH to the terminal's foreground process group: cordon.
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def send(self, data):
        os.write(self.master, data)

    def expect(self, pattern, again=None):
        """Reads until `pattern` (a regex on bytes) appears in what came since the last match;
        `again` is sent every half second meanwhile (for a change that takes a moment to land)."""
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            m = re.search(pattern, self.seen)
            if m:
                self.seen = self.seen[m.end():]
                return m
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if ready:
                try:
                    self.seen += os.read(self.master, 65536)
                except OSError:
                    break
            elif again:
                self.send(again)
        raise AssertionError(f"{pattern!r} never came; got {self.seen[-2000:]!r}")

    def wait(self):
        """The exit status of `cordon shell`, reading what it prints meanwhile, as a terminal
        does: a writer to a terminal nobody reads would block."""
        deadline = time.monotonic() + PATIENCE
        while self.proc.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if ready:
                try:
                    self.seen += os.read(self.master, 65536)
                except OSError:
                    pass
        if self.proc.poll() is None:
            raise AssertionError(f"cordon shell did not exit; the terminal showed {self.seen[-2000:]!r}")
        return self.proc.returncode

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        os.close(self.master)
        os.close(self.slave)


def test_shell_is_an_interactive_terminal(sbx):
    t = Terminal(sbx.sandbox_id, 30, 100)
    try:
        # The prompt: keys sent before would meet our terminal still in cooked mode.
        t.expect(rb"\$ ")
        t.send(b"echo $((6*7))\r")
        t.expect(rb"\r42\r\n")
        t.send(b"stty size\r")
        t.expect(rb"\r30 100\r\n")
        t.resize(40, 120)
        t.send(b"stty size\r")
        t.expect(rb"\r40 120\r\n", again=b"stty size\r")
        # Ctrl-C reaches the sandbox's terminal as a key and interrupts what runs there.
        # The job prints once it holds the terminal's foreground (bash hands it over in the
        # child before the exec), so the key cannot land in bash while the job is starting.
        t.send(b"sh -c 'echo st''arted; exec sleep 100'\r")
        t.expect(rb"started\r\n")
        t.send(b"\x03")
        t.send(b"echo after$((1+1))\r")
        t.expect(rb"after2")
        t.send(b"exit\r")
        assert t.wait() == 0
        # Our terminal's settings are back as they were.
        assert termios.tcgetattr(t.slave) == t.before
    finally:
        t.close()


def test_shell_restores_the_terminal_when_killed(sbx):
    t = Terminal(sbx.sandbox_id, 24, 80)
    try:
        t.expect(rb"\$ ")
        t.send(b"echo re''ady\r")
        t.expect(rb"ready\r\n")
        assert termios.tcgetattr(t.slave) != t.before, "the shell should have put the terminal in raw mode"
        t.proc.terminate()
        assert t.proc.wait(timeout=PATIENCE) == 128 + 15
        assert termios.tcgetattr(t.slave) == t.before
    finally:
        t.close()


def test_cp_both_ways_byte_for_byte(sbx, tmp_path):
    data = os.urandom(3 << 20)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    r = cordon("cp", str(src), f"{sbx.sandbox_id}:/tmp/up/blob.bin")
    assert r.returncode == 0, r
    got = sbx.commands.run("sha256sum /tmp/up/blob.bin").stdout.split()[0]
    assert got == hashlib.sha256(data).hexdigest()
    # To a directory: under the source's name.
    r = cordon("cp", str(src), f"{sbx.sandbox_id}:/tmp/up/")
    assert r.returncode == 0, r
    back = tmp_path / "back"
    back.mkdir()
    r = cordon("cp", f"{sbx.sandbox_id}:/tmp/up/blob.bin", str(back))
    assert r.returncode == 0, r
    assert (back / "blob.bin").read_bytes() == data
    # A directory is refused, saying so.
    r = cordon("cp", f"{sbx.sandbox_id}:/tmp/up", str(back))
    assert r.returncode == 2 and "directory" in one_line_error(r), r
    r = cordon("cp", str(back), f"{sbx.sandbox_id}:/tmp/x")
    assert r.returncode == 2 and "directory" in one_line_error(r), r
    r = cordon("cp", f"{sbx.sandbox_id}:/tmp/absent", str(back / "x"))
    assert r.returncode == 1, r
    one_line_error(r)


def test_kill_ends_sandboxes_and_names_unknown_ones():
    a = Sandbox.create(timeout=300)
    b = Sandbox.create(timeout=300)
    r = cordon("kill", a.sandbox_id)
    assert (r.returncode, r.stdout) == (0, f"{a.sandbox_id}\n".encode()), r
    r = cordon("kill", "nosuchsandbox1", b.sandbox_id)
    assert r.returncode == 1 and r.stdout == f"{b.sandbox_id}\n".encode(), r
    err = r.stderr.decode()
    assert err.count("\n") == 1 and "nosuchsandbox1" in err and "not found" in err, err
    rows = ps_rows("--all")
    assert a.sandbox_id not in rows and b.sandbox_id not in rows
    for s in (a, b):
        assert httpx.get(f"{API_URL}/sandboxes/{s.sandbox_id}", headers=H).status_code == 404


def test_audit_shows_a_denied_syscall(sbx):
    out = sbx.commands.run("unshare -U true || echo denied", timeout=60)
    assert "denied" in out.stdout, out
    r = cordon("audit", sbx.sandbox_id)
    assert r.returncode == 0, r
    text = r.stdout.decode()
    assert re.search(r"^  unshare\s+\d+", text, re.M), text
    assert "blocked connections: none" in text, text
    r = cordon("audit", "--json", sbx.sandbox_id)
    names = {d["syscall"] for d in json.loads(r.stdout)["deniedSyscalls"]}
    assert "unshare" in names


@pytest.fixture(scope="module")
def start_template():
    """A template whose start command prints on both streams, then serves HTTP (and logs every
    request to stderr, after readiness)."""
    name = f"tpl-cli-logs-{secrets.token_hex(4)}"
    start = "sh -c 'echo hello-from-start; echo warm-on-stderr >&2; exec python3 -m http.server 8000'"
    Template.build(Template().from_template("base").set_start_cmd(start, wait_for_port(8000)), name)
    yield name
    httpx.delete(f"{API_URL}/templates/{name}", headers=H)


def test_logs_show_the_start_commands_output_and_follow_it(start_template):
    s = Sandbox.create(start_template, timeout=300)
    try:
        r = cordon("logs", s.sandbox_id)
        assert r.returncode == 0, r
        assert "hello-from-start" in r.stdout.decode() and "warm-on-stderr" in r.stderr.decode(), r
        follow = subprocess.Popen([BIN, "logs", "--follow", s.sandbox_id], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            # http.server logs each request on stderr: output after the start command was ready.
            marker = f"marker-{secrets.token_hex(4)}"
            s.commands.run(f"curl -s -o /dev/null http://127.0.0.1:8000/{marker}")
            deadline = time.monotonic() + PATIENCE
            seen = b""
            while marker.encode() not in seen and time.monotonic() < deadline:
                ready, _, _ = select.select([follow.stderr], [], [], 0.5)
                if ready:
                    seen += os.read(follow.stderr.fileno(), 65536)
            assert marker.encode() in seen, seen
            # Printed once, though the follow asked many times.
            assert seen.count(b"warm-on-stderr") == 1, seen
            s.kill()
            assert follow.wait(timeout=PATIENCE) == 0
        finally:
            follow.kill()
    finally:
        s.kill()


def test_logs_endpoints_answer_as_e2b_does(start_template):
    s = Sandbox.create(start_template, timeout=300)
    try:
        v1 = httpx.get(f"{API_URL}/sandboxes/{s.sandbox_id}/logs", headers=H).json()
        assert {"logs", "logEntries"} <= v1.keys()
        assert any(e["message"] == "hello-from-start" and e["level"] == "info" for e in v1["logEntries"]), v1
        assert json.loads(v1["logs"][0]["line"])["level"] in ("info", "error")
        v2 = httpx.get(f"{API_URL}/v2/sandboxes/{s.sandbox_id}/logs", params={"level": "error"}, headers=H).json()
        assert [e["message"] for e in v2["logs"]][:1] == ["warm-on-stderr"], v2
        r = httpx.get(f"{API_URL}/v2/sandboxes/{s.sandbox_id}/logs", params={"direction": "sideways"}, headers=H)
        assert r.status_code == 400
    finally:
        s.kill()
    for path in ("/sandboxes/nosuchsandbox1/logs", "/v2/sandboxes/nosuchsandbox1/logs", f"/sandboxes/{s.sandbox_id}/logs"):
        assert httpx.get(API_URL + path, headers=H).status_code == 404, path


def test_code_interpreter_logs_are_kept():
    from e2b_code_interpreter import Sandbox as CodeSandbox

    s = CodeSandbox.create(timeout=300)
    try:
        s.run_code("1+1")
        r = cordon("logs", s.sandbox_id)
        assert r.returncode == 0, r
        assert (r.stdout + r.stderr).strip(), "the interpreter's server printed nothing that was kept"
    finally:
        s.kill()


def test_bad_input_is_one_line_and_the_right_exit_code(tmp_path):
    for args in (("exec", "nosuchsandbox1", "--", "true"), ("logs", "nosuchsandbox1"), ("audit", "nosuchsandbox1")):
        r = cordon(*args)
        assert r.returncode == 1 and "not found" in one_line_error(r), (args, r)
    r = cordon("cp", str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.returncode == 2 and "ID:/path" in one_line_error(r), r
    r = cordon("exec", "Not-An-Id", "--", "true")
    assert r.returncode == 2, r
    one_line_error(r)
    env = {k: v for k, v in os.environ.items() if k != "E2B_API_KEY"}
    r = cordon("ps", env=env)
    assert r.returncode == 2 and "E2B_API_KEY" in one_line_error(r), r
    r = cordon("ps", "--server", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 1 and "cannot reach" in one_line_error(r), r
    r = cordon("exec", "abc", "ls")
    assert r.returncode == 2 and "--" in one_line_error(r), r
