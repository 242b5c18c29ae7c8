"""AsyncSandbox: run with callbacks, background, files, and the streaming WatchDir."""

import asyncio

from e2b import AsyncSandbox, FilesystemEventType


async def test_async_run_and_files():
    sbx = await AsyncSandbox.create(timeout=60)
    try:
        chunks = []
        r = await sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=chunks.append)
        assert r.stdout == "1\n2\n3\n" and "".join(chunks) == r.stdout
        await sbx.files.write("/tmp/a.txt", "async")
        assert await sbx.files.read("/tmp/a.txt") == "async"
        h = await sbx.commands.run("sleep 0.5; echo bg", background=True)
        assert (await h.wait()).stdout == "bg\n"
        assert await sbx.is_running()
    finally:
        await sbx.kill()


async def test_async_watch_dir():
    sbx = await AsyncSandbox.create(timeout=60)
    try:
        await sbx.files.make_dir("/tmp/watched")
        events = []
        handle = await sbx.files.watch_dir("/tmp/watched", on_event=events.append)
        await sbx.files.write("/tmp/watched/new.txt", "x")
        for _ in range(50):
            if any(e.name == "new.txt" for e in events):
                break
            await asyncio.sleep(0.1)
        await handle.stop()
        assert any(e.name == "new.txt" and e.type in (FilesystemEventType.CREATE, FilesystemEventType.WRITE) for e in events), events
    finally:
        await sbx.kill()


def test_sync_watch_dir(shared):
    shared.files.make_dir("/tmp/watched-sync")
    handle = shared.files.watch_dir("/tmp/watched-sync")
    shared.files.write("/tmp/watched-sync/f.txt", "x")
    events = []
    for _ in range(20):
        events += handle.get_new_events()
        if any(e.name == "f.txt" for e in events):
            break
    handle.stop()
    assert any(e.name == "f.txt" for e in events), events
