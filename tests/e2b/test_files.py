"""filesystem.Filesystem and /files through the SDK."""

import httpx
import pytest
from e2b import FileNotFoundException, FileType, SandboxException


def test_write_read_text_and_bytes(shared, unique):
    p = f"/home/user/{unique}.txt"
    info = shared.files.write(p, "héllo")
    assert info.path == p
    assert shared.files.read(p) == "héllo"
    assert shared.files.read(p, format="bytes") == "héllo".encode()
    raw = bytes(range(256)) * 100
    shared.files.write(f"{unique}.bin", raw)  # relative to the home dir
    assert shared.files.read(f"/home/user/{unique}.bin", format="bytes") == raw
    stream = shared.files.read(f"{unique}.bin", format="stream")
    assert b"".join(stream) == raw


def test_read_missing_raises(shared):
    with pytest.raises(FileNotFoundException):
        shared.files.read("/nope/missing.txt")


@pytest.mark.parametrize("size", [10, 1 << 20, 16 << 20])
def test_a_refused_upload_of_any_size_says_why(shared, size):
    # The agent refuses before it has read the body; it must still read it, or the client's
    # write breaks and the SDK reports an unreachable sandbox instead of the refusal.
    with pytest.raises(SandboxException) as e:
        shared.files.write("/root/not-yours.bin", b"x" * size)
    assert "403" in str(e.value) and "Permission denied" in str(e.value), e.value
    # The sandbox and the connection to it are fine afterwards.
    assert shared.files.write("/tmp/after-refusal.bin", b"y" * size).path == "/tmp/after-refusal.bin"


def test_list_exists_info(shared, unique):
    d = f"/tmp/{unique}"
    shared.files.write(f"{d}/a.txt", "a")
    shared.files.write(f"{d}/sub/b.txt", "bb")
    names = sorted(e.name for e in shared.files.list(d))
    assert names == ["a.txt", "sub"]
    deep = sorted(e.path for e in shared.files.list(d, depth=2))
    assert deep == [f"{d}/a.txt", f"{d}/sub", f"{d}/sub/b.txt"]
    assert shared.files.exists(f"{d}/a.txt")
    assert not shared.files.exists(f"{d}/zzz")
    info = shared.files.get_info(f"{d}/sub/b.txt")
    assert info.type == FileType.FILE and info.size == 2


def test_make_dir_twice_rename_remove(shared, unique):
    d = f"/tmp/{unique}-dir/x/y"
    assert shared.files.make_dir(d) is True
    assert shared.files.make_dir(d) is False
    shared.files.write(f"/tmp/{unique}-f", "1")
    moved = shared.files.rename(f"/tmp/{unique}-f", f"/tmp/{unique}-g")
    assert moved.path == f"/tmp/{unique}-g"
    assert not shared.files.exists(f"/tmp/{unique}-f")
    shared.files.remove(f"/tmp/{unique}-g")
    assert not shared.files.exists(f"/tmp/{unique}-g")
    shared.files.remove(f"/tmp/{unique}-never-existed")  # no error


def test_write_many(shared, unique):
    entries = [{"path": f"/tmp/{unique}/m{i}.txt", "data": f"n{i}"} for i in range(5)]
    infos = shared.files.write_files(entries)
    assert sorted(i.path for i in infos) == sorted(e["path"] for e in entries)
    for e in entries:
        assert shared.files.read(e["path"]) == e["data"]


def test_gzip_and_metadata(shared, unique):
    p = f"/tmp/{unique}-gz"
    shared.files.write(p, "x" * 10000, gzip=True, metadata={"Owner": "tests"})
    assert shared.files.read(p, gzip=True) == "x" * 10000
    assert shared.files.get_info(p).metadata.get("owner") == "tests"


def test_a_write_replaces_the_metadata_of_the_one_before(shared, unique):
    # A file written again carries only what the new write says: no metadata, none left.
    p = f"/tmp/{unique}-meta"
    first = shared.files.write(p, "one", metadata={"owner": "tests", "stage": "draft"})
    assert first.metadata == {"owner": "tests", "stage": "draft"}
    second = shared.files.write(p, "two", metadata={"stage": "final"})
    assert second.metadata == {"stage": "final"}
    third = shared.files.write(p, "three")
    assert not third.metadata, third.metadata
    assert not shared.files.get_info(p).metadata
    assert shared.files.read(p) == "three"


def test_expired_and_forged_signed_urls_get_envds_answer(shared, unique):
    # The SDK's URLs name no sandbox: the signature does, expired or not. E2B's answers.
    p = f"/tmp/{unique}-expiring"
    shared.files.write(p, "x")
    r = httpx.get(shared.download_url(p, use_signature_expiration=-30))
    assert r.status_code == 401 and "signature is already expired" in r.text, r.text
    up = shared.upload_url(p, use_signature_expiration=-30)
    r = httpx.post(up, files={"file": ("x", b"late")})
    assert r.status_code == 401 and "signature is already expired" in r.text, r.text
    assert shared.files.read(p) == "x"
    forged = shared.download_url(p).replace("signature=v1_", "signature=v1_A")
    r = httpx.get(forged)
    assert r.status_code == 401 and "invalid signature" in r.text and "API key" not in r.text, r.text


def test_signed_urls(shared, unique):
    p = f"/tmp/{unique}-signed"
    up = shared.upload_url(p, use_signature_expiration=60)
    r = httpx.post(up, files={"file": ("x", b"signed-body")})
    assert r.status_code == 200, r.text
    down = shared.download_url(p)
    r = httpx.get(down)
    assert r.status_code == 200 and r.content == b"signed-body"
    # A tampered signature is refused.
    r = httpx.get(down.replace("signature=v1_", "signature=v1_A"))
    assert r.status_code == 401
