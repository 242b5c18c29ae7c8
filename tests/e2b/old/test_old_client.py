"""Smoke test with an older SDK (2.45): create via POST /sandboxes, connect via
POST /sandboxes/{id}/connect, commands, files, list, kill."""

import e2b
import pytest
from e2b import CommandExitException, Sandbox


def test_version_is_old():
    import importlib.metadata

    assert importlib.metadata.version("e2b").startswith("2.45.")


def test_old_client_flow():
    sbx = Sandbox.create(timeout=60, metadata={"old": "client"}, envs={"X": "y"})
    try:
        assert sbx.is_running()
        assert sbx.commands.run("echo $X").stdout == "y\n"
        with pytest.raises(CommandExitException):
            sbx.commands.run("exit 2")
        sbx.files.write("/tmp/old.txt", "old")
        assert sbx.files.read("/tmp/old.txt") == "old"
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.commands.run("cat /tmp/old.txt").stdout == "old"
        h = again.commands.run("read l; echo $l", background=True, stdin=True)
        again.commands.send_stdin(h.pid, "in\n")
        assert h.wait().stdout == "in\n"
        ids = [s.sandbox_id for s in Sandbox.list(query=e2b.SandboxQuery(metadata={"old": "client"})).next_items()]
        assert sbx.sandbox_id in ids
    finally:
        assert sbx.kill() is True
    assert not sbx.is_running()
