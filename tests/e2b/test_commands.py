"""process.Process through the SDK: run, exit codes, env, cwd, deadlines, background, stdin."""

import time

import pytest
from e2b import CommandExitException, TimeoutException


def test_run_stdout_stderr_and_callbacks(shared):
    seen = []
    r = shared.commands.run("echo out; echo err >&2", on_stdout=seen.append)
    assert r.exit_code == 0
    assert r.stdout == "out\n"
    assert r.stderr == "err\n"
    assert "".join(seen) == "out\n"


def test_exit_code_raises(shared):
    with pytest.raises(CommandExitException) as e:
        shared.commands.run("echo before; exit 3")
    assert e.value.exit_code == 3
    assert e.value.stdout == "before\n"


def test_envs_and_cwd_and_user(shared):
    assert shared.commands.run("echo $A-$B", envs={"A": "1", "B": "two"}).stdout == "1-two\n"
    assert shared.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert shared.commands.run("pwd").stdout == "/home/user\n"
    assert shared.commands.run("whoami").stdout == "user\n"
    assert shared.commands.run("whoami", user="root").stdout == "root\n"


def test_timeout(shared):
    start = time.time()
    with pytest.raises(TimeoutException):
        shared.commands.run("sleep 30", timeout=1)
    assert time.time() - start < 10


def test_background_list_and_kill(shared):
    h = shared.commands.run("sleep 60", background=True)
    assert h.pid > 0
    assert h.pid in [p.pid for p in shared.commands.list()]
    assert shared.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()
    assert h.pid not in [p.pid for p in shared.commands.list()]
    assert shared.commands.kill(h.pid) is False


def test_kill_returns_once_the_process_is_gone(shared):
    # E2B's kill returns after the process has ended, so a `kill -0` of its pid right after
    # fails: every time, not just usually.
    for _ in range(20):
        h = shared.commands.run("sleep 60", background=True)
        assert shared.commands.kill(h.pid) is True
        r = shared.commands.run(f"kill -0 {h.pid} 2>/dev/null && echo alive || echo gone")
        assert r.stdout == "gone\n", f"pid {h.pid} still there right after kill"


def test_python_is_python3(shared):
    # E2B's base has `python`; its docs start servers with `python -m http.server`.
    r = shared.commands.run("python -c 'import sys; print(sys.version_info[0] * 14)'")
    assert r.stdout == "42\n"


def test_stdin(shared):
    h = shared.commands.run("read line; echo got:$line", background=True, stdin=True)
    shared.commands.send_stdin(h.pid, "hello\n")
    r = h.wait()
    assert r.stdout == "got:hello\n"
    h = shared.commands.run("cat", background=True, stdin=True)
    shared.commands.send_stdin(h.pid, "abc")
    shared.commands.close_stdin(h.pid)
    assert h.wait().stdout == "abc"


def test_connect_to_running_pid(shared):
    h = shared.commands.run("sleep 1; echo late", background=True)
    again = shared.commands.connect(h.pid)
    r = again.wait()
    assert r.stdout == "late\n" and r.exit_code == 0


def test_disconnect_does_not_kill(shared):
    h = shared.commands.run("sleep 2; echo survived > /tmp/survived", background=True)
    h.disconnect()
    time.sleep(3)
    assert shared.files.read("/tmp/survived") == "survived\n"


def test_large_output_streams(shared):
    r = shared.commands.run("head -c 3000000 /dev/zero | tr '\\0' a")
    assert len(r.stdout) == 3_000_000


def test_output_streams_live(shared):
    stamps = []
    shared.commands.run("echo a; sleep 1; echo b", on_stdout=lambda s: stamps.append((time.time(), s)))
    assert "".join(s for _, s in stamps) == "a\nb\n"
    # Each chunk is flushed through the proxy as it comes, not buffered to the end.
    assert len(stamps) >= 2 and stamps[-1][0] - stamps[0][0] > 0.8


def test_kill_sandbox_while_command_runs(sandbox):
    h = sandbox.commands.run("sleep 30", background=True)
    start = time.time()
    sandbox.kill()
    with pytest.raises(Exception) as e:
        h.wait()
    assert time.time() - start < 10
    assert "killed or reached its end of life" in str(e.value) or "not found" in str(e.value).lower(), repr(e.value)
