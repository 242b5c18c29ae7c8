"""Control plane: create, info, list, connect, timeouts, kill, errors."""

import threading
import time
from datetime import datetime, timedelta

import httpx
import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    Sandbox,
    SandboxException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
    Template,
)

from conftest import API_KEY, API_URL, BASE_URL


def test_create_is_running_kill():
    sbx = Sandbox.create(timeout=60)
    assert sbx.sandbox_id.startswith("i") and len(sbx.sandbox_id) == 21
    assert sbx.is_running()
    assert sbx.kill() is True
    assert not sbx.is_running()
    # A second kill finds nothing: the SDK turns the 404 into False.
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_create_with_envs_and_metadata_and_info(unique):
    sbx = Sandbox.create(timeout=90, envs={"SBX_LEVEL": "from-create"}, metadata={"id": unique})
    try:
        assert sbx.commands.run("echo $SBX_LEVEL").stdout.strip() == "from-create"
        # Per-command envs win over sandbox-level ones.
        out = sbx.commands.run("echo $SBX_LEVEL", envs={"SBX_LEVEL": "cmd"}).stdout.strip()
        assert out == "cmd"
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.metadata == {"id": unique}
        assert info.template_id == "base"
        assert info.state.value == "running"
        left = (info.end_at - info.started_at).total_seconds()
        assert 80 <= left <= 100, left
        assert info.cpu_count >= 1 and info.memory_mb >= 16
    finally:
        sbx.kill()


def test_set_timeout_then_expiry():
    sbx = Sandbox.create(timeout=60)
    try:
        sbx.set_timeout(3)
        end = sbx.get_info().end_at.timestamp()
        assert end - time.time() < 5
        deadline = time.time() + 10
        while sbx.is_running() and time.time() < deadline:
            time.sleep(0.5)
        assert not sbx.is_running()
        with pytest.raises(Exception):
            sbx.commands.run("true")
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_list_with_metadata_filter_and_pagination(unique):
    made = [Sandbox.create(timeout=60, metadata={"list_test": unique, "n": str(i)}) for i in range(3)]
    try:
        other = Sandbox.create(timeout=60, metadata={"list_test": "someone-else"})
        try:
            found = Sandbox.list(query=SandboxQuery(metadata={"list_test": unique})).next_items()
            assert sorted(s.sandbox_id for s in found) == sorted(s.sandbox_id for s in made)
            assert all(s.metadata["list_test"] == unique for s in found)
            # Two pages of two and one.
            pager = Sandbox.list(query=SandboxQuery(metadata={"list_test": unique}), limit=2)
            first = pager.next_items()
            assert len(first) == 2 and pager.has_next
            second = pager.next_items()
            assert len(second) == 1 and not pager.has_next
            assert {s.sandbox_id for s in first + second} == {s.sandbox_id for s in made}
            recent = SandboxQuery(metadata={"list_test": unique}, started_after=datetime.now() - timedelta(minutes=5))
            assert len(Sandbox.list(query=recent).next_items()) == 3
            future = SandboxQuery(metadata={"list_test": unique}, started_after=datetime.now() + timedelta(hours=1))
            assert Sandbox.list(query=future).next_items() == []
            # Paused sandboxes do not exist here.
            paused = Sandbox.list(query=SandboxQuery(metadata={"list_test": unique}, state=[SandboxState.PAUSED])).next_items()
            assert paused == []
        finally:
            other.kill()
    finally:
        for s in made:
            s.kill()


def test_list_is_newest_first_unless_asked_otherwise(unique):
    # E2B's default order is desc: `limit=1` gives the newest, and pages walk back in time.
    made = []
    try:
        for i in range(3):
            made.append(Sandbox.create(timeout=60, metadata={"order_test": unique, "n": str(i)}))
        q = SandboxQuery(metadata={"order_test": unique})
        newest_first = [s.sandbox_id for s in reversed(made)]
        assert [s.sandbox_id for s in Sandbox.list(query=q).next_items()] == newest_first
        pager = Sandbox.list(query=q, limit=1)
        walked = []
        while pager.has_next:
            walked += [s.sandbox_id for s in pager.next_items()]
        assert walked == newest_first
        assert [s.sandbox_id for s in Sandbox.list(query=q, order="desc").next_items()] == newest_first
        pager = Sandbox.list(query=q, limit=2, order="asc")
        walked = []
        while pager.has_next:
            walked += [s.sandbox_id for s in pager.next_items()]
        assert walked == newest_first[::-1]
        bad = httpx.get(f"{API_URL}/v2/sandboxes", params={"order": "sideways"}, headers={"X-API-KEY": API_KEY})
        assert bad.status_code == 400 and "asc or desc" in bad.text, bad.text
    finally:
        for s in made:
            s.kill()


def test_template_exists_for_the_templates_a_create_accepts(unique):
    # What the SDK's Template.exists asks (GET /templates/aliases/{name}): true for the built-in
    # templates, built or not yet, false for a name no create would accept.
    assert Template.exists("base") is True
    assert Template.exists("code-interpreter-v1") is True
    assert Template.exists(f"no-such-template-{unique}") is False


def test_a_sandbox_killed_during_a_streaming_command_is_reported_as_gone():
    # The stream ends as envd ends one whose process side went away; the SDK then finds the
    # sandbox gone and says so, rather than blaming a protocol error on a timeout.
    # The kill comes once the command's first output has arrived, however slow the machine.
    sbx = Sandbox.create(timeout=60)
    killers = []

    def kill_on_output(_):
        if not killers:
            killers.append(threading.Thread(target=Sandbox.kill, args=(sbx.sandbox_id,)))
            killers[0].start()

    try:
        with pytest.raises(SandboxNotRunningException) as ei:
            sbx.commands.run("echo started; sleep 30", timeout=60, on_stdout=kill_on_output)
        assert killers, "the command never printed"
        assert "killed or reached its end of life" in str(ei.value), str(ei.value)
    finally:
        for k in killers:
            k.join()
        Sandbox.kill(sbx.sandbox_id)


def test_connect_by_id(unique):
    sbx = Sandbox.create(timeout=60)
    try:
        sbx.files.write(f"/tmp/{unique}", "kept")
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.sandbox_id == sbx.sandbox_id
        assert again.files.read(f"/tmp/{unique}") == "kept"
        assert again.commands.run("echo ok").stdout == "ok\n"
    finally:
        sbx.kill()


def test_connect_unknown_fails():
    with pytest.raises(SandboxException):
        Sandbox.connect("i00000000000000000000")


def test_kill_then_calls_fail_cleanly(sandbox):
    sandbox.kill()
    assert not sandbox.is_running()
    for call in (
        lambda: sandbox.commands.run("true"),
        lambda: sandbox.files.read("/etc/hostname"),
        lambda: sandbox.files.write("/tmp/x", "y"),
        lambda: sandbox.files.list("/"),
        lambda: sandbox.get_info(),
    ):
        with pytest.raises(Exception) as e:
            call()
        assert "Traceback" not in str(e.value)
    r = httpx.get(f"{BASE_URL}/health", headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"})
    assert r.status_code == 502
    assert r.json() == {"sandboxId": sandbox.sandbox_id, "message": "The sandbox was not found", "code": 502}


def test_metrics(sandbox):
    # Burn some CPU and write 8 MiB to the writable layer, then both must show in the latest
    # sample (the list is oldest first).
    sandbox.commands.run("head -c 8M /dev/zero > /home/user/blob; python3 -c 'sum(range(10**7))'")
    m = sandbox.get_metrics()
    assert len(m) >= 1
    assert [s.timestamp for s in m] == sorted(s.timestamp for s in m)
    last = m[-1]
    assert last.mem_total > 0 and last.mem_used > 0
    assert last.cpu_used_pct > 0
    assert last.disk_used >= 8 << 20 and last.disk_total >= last.disk_used


def test_metrics_time_range():
    # One sample every 5 s is kept: a range inside the sandbox's life has samples, each inside
    # it; a range that ends before the sandbox existed has none.
    before = datetime.now() - timedelta(seconds=2)
    sbx = Sandbox.create(timeout=60)
    try:
        time.sleep(6)
        # The range's end lies ahead, so the sample taken for this request is in it too however
        # long the request takes.
        now = datetime.now() + timedelta(seconds=60)
        m = sbx.get_metrics(start=before, end=now)
        assert len(m) >= 2, m
        for s in m:
            assert before.timestamp() - 1 <= s.timestamp.timestamp() <= now.timestamp() + 1, (s.timestamp, before, now)
        earlier = sbx.get_metrics(start=before - timedelta(hours=2), end=before - timedelta(hours=1))
        assert earlier == []
        bad = httpx.get(f"{API_URL}/sandboxes/{sbx.sandbox_id}/metrics", params={"start": "yesterday"}, headers={"X-API-KEY": API_KEY})
        assert bad.status_code == 400, bad.text
    finally:
        sbx.kill()


def test_wrong_api_key():
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_1111111111111111111111111111111111111111")
    r = httpx.get(f"{API_URL}/v2/sandboxes", headers={"X-API-KEY": "nope"})
    assert r.status_code == 401 and r.json()["code"] == 401


def test_unknown_template_and_tier():
    with pytest.raises(SandboxException) as e:
        Sandbox.create("no-such-template")
    assert "no-such-template" in str(e.value)
    r = httpx.post(f"{API_URL}/sandboxes", headers={"X-API-KEY": API_KEY}, json={"templateID": "base", "tier": "no-such-tier"})
    assert r.status_code == 400 and "tier" in r.json()["message"]
    r = httpx.post(f"{API_URL}/sandboxes", headers={"X-API-KEY": API_KEY}, content=b"{not json")
    assert r.status_code == 400 and r.json()["code"] == 400


def test_resource_extensions():
    r = httpx.post(
        f"{API_URL}/v2/sandboxes",
        headers={"X-API-KEY": API_KEY},
        json={"templateID": "base", "timeout": 30, "cpuCount": 2, "memoryMB": 256, "diskSizeMB": 64},
    )
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    try:
        info = Sandbox.get_info(sid)
        assert (info.cpu_count, info.memory_mb) == (2, 256)
        raw = httpx.get(f"{API_URL}/sandboxes/{sid}", headers={"X-API-KEY": API_KEY}).json()
        assert raw["diskSizeMB"] == 64 and raw["state"] == "running"
        sbx = Sandbox.connect(sid)
        # The writable layer is capped at diskSizeMB.
        with pytest.raises(CommandExitException) as e:
            sbx.commands.run("dd if=/dev/zero of=/home/user/big bs=1M count=100", timeout=30)
        assert "No space left" in e.value.stderr
    finally:
        Sandbox.kill(sid)
