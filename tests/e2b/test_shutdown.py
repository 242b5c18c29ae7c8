"""`cordon serve --shutdown drain`: on SIGTERM the server refuses new sandboxes, serves the live
ones until they end (and then stops at once), or until `--drain-grace` passes (and then destroys
what is left, leaving no cgroup and no process behind)."""

import glob
import os
import signal
import time

from e2b import Sandbox

from conftest import Serve


def cgroups_of(sid):
    """The sandbox's cgroup directories on the host (v1 hierarchies and the unified one)."""
    return glob.glob(f"/sys/fs/cgroup/*/cordon/{sid}") + glob.glob(f"/sys/fs/cgroup/cordon/{sid}")


def processes_of(sid):
    """Host pids whose cgroup names the sandbox."""
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cgroup", errors="replace") as f:
                if f"/cordon/{sid}" in f.read():
                    found.append(p)
        except OSError:
            pass  # gone meanwhile
    return found


def exited_within(proc, secs):
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return True
        time.sleep(0.1)
    return False


def test_a_draining_server_refuses_creates_serves_its_sandboxes_and_stops_when_they_end(tmp_path):
    with open(tmp_path / "serve.log", "wb") as log:
        srv = Serve("--shutdown", "drain", "--drain-grace", "10m", log=log).start()
    try:
        sbx = Sandbox.create(timeout=300, **srv.sdk())
        assert cgroups_of(sbx.sandbox_id)
        srv.proc.send_signal(signal.SIGTERM)
        # Refused as soon as the drain begins.
        deadline = time.monotonic() + 30
        while True:
            r = srv.api("POST", "/sandboxes", json={"templateID": "base", "timeout": 30})
            if r.status_code == 503 or time.monotonic() > deadline:
                break
            srv.api("DELETE", f"/sandboxes/{r.json()['sandboxID']}")
            time.sleep(0.1)
        assert r.status_code == 503 and "shutting down" in r.json()["message"], r.text
        # The live sandbox goes on working meanwhile, and the server does not stop under it.
        for i in range(3):
            assert sbx.commands.run(f"echo still {i}", timeout=30).stdout == f"still {i}\n"
        assert srv.proc.poll() is None, "the server stopped with a live sandbox"
        # Its last sandbox ended: the server stops (long before the grace).
        sbx.kill()
        assert exited_within(srv.proc, 120), "the server did not stop once its last sandbox ended"
        assert srv.proc.returncode == 0, (tmp_path / "serve.log").read_text()
        assert not cgroups_of(sbx.sandbox_id)
    finally:
        srv.stop(signal.SIGKILL)


def test_a_drain_that_outlasts_its_grace_destroys_what_is_left(tmp_path):
    grace = 3
    with open(tmp_path / "serve.log", "wb") as log:
        srv = Serve("--shutdown", "drain", "--drain-grace", f"{grace}s", log=log).start()
    try:
        sbx = Sandbox.create(timeout=300, **srv.sdk())
        pids = processes_of(sbx.sandbox_id)
        assert pids, "no process of the sandbox found by its cgroup"
        sent = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert exited_within(srv.proc, 120), "the server did not stop after its grace"
        # Not before the grace: the sandbox was served until then.
        assert time.monotonic() - sent >= grace
        assert srv.proc.returncode == 0, (tmp_path / "serve.log").read_text()
        assert not cgroups_of(sbx.sandbox_id), cgroups_of(sbx.sandbox_id)
        assert not processes_of(sbx.sandbox_id), "a process of the sandbox outlived the server"
    finally:
        srv.stop(signal.SIGKILL)
