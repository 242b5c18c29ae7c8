"""Volumes through the real `e2b` package: `Volume.create` and the content API (at
E2B_VOLUME_API_URL, with the volume's own token), `volume_mounts=` on create, on the ns and
gvisor tiers at once, and the attacks a volume invites: symlinks planted from inside a sandbox
and read from outside, a sandbox that fills its volume, a damaged image, bad mounts.

gVisor's old runsc refuses statx's AT_NO_AUTOMOUNT (so `ls -l` and `stat` fail there with
EINVAL): owners are read with Python's os.stat inside every sandbox."""

import json
import os
import subprocess
import uuid

import httpx
import pytest
from e2b import Sandbox, Volume, VolumePathNotFoundException

from conftest import API_KEY, API_URL, Serve, needs_runsc

HEADERS = {"X-API-KEY": API_KEY}
STATE = "/var/lib/cordon"
CORDON = os.environ.get("CORDON_BIN", "cordon")

STAT_PY = (
    "import json, os, sys; "
    "print(json.dumps({n: [os.stat(os.path.join(sys.argv[1], n)).st_uid, os.stat(os.path.join(sys.argv[1], n)).st_gid, "
    "os.stat(os.path.join(sys.argv[1], n)).st_mode & 0o7777] for n in sorted(os.listdir(sys.argv[1]))}))"
)


def owners(sbx, path):
    """{name: [uid, gid, mode]} of a directory's entries, as the sandbox sees them."""
    out = sbx.commands.run(f"python3 -c '{STAT_PY}' {path}").stdout
    return json.loads(out)


def create_gvisor(**body):
    r = httpx.post(f"{API_URL}/sandboxes", headers=HEADERS, json={"templateID": "base", "tier": "gvisor", "timeout": 120, **body}, timeout=120)
    assert r.status_code == 201, r.text
    return Sandbox.connect(r.json()["sandboxID"])


@pytest.fixture
def volume():
    vol = Volume.create(f"t-{uuid.uuid4().hex[:12]}")
    try:
        yield vol
    finally:
        # Whatever the test left mounted is killed with it; the volume goes last.
        Volume.destroy(vol.volume_id)


@needs_runsc
def test_one_volume_in_two_tiers_then_a_third_sandbox(volume):
    vol = volume
    vol.make_dir("/seed", uid=1000, gid=1000)
    vol.write_file("/seed/hello.txt", "from the api", uid=1000, gid=1000, mode=0o640)
    vol.write_file("/seed/root.txt", "root's")
    listed = {e.name: (e.uid, e.gid, e.mode) for e in vol.list("/seed")}
    assert listed == {"hello.txt": (1000, 1000, 0o640), "root.txt": (0, 0, 0o644)}

    ns = Sandbox.create(timeout=120, volume_mounts={"/mnt/data": vol})
    gv = None
    try:
        gv = create_gvisor(volumeMounts=[{"name": vol.name, "path": "/mnt/data"}])
        want = {"hello.txt": [1000, 1000, 0o640], "root.txt": [0, 0, 0o644]}
        assert owners(ns, "/mnt/data/seed") == want
        assert owners(gv, "/mnt/data/seed") == want
        assert ns.commands.run("cat /mnt/data/seed/hello.txt").stdout == "from the api"
        assert gv.commands.run("cat /mnt/data/seed/hello.txt").stdout == "from the api"
        # The default user may not read root's 0640 file elsewhere, and the modes hold.
        ns.commands.run("echo from ns > /mnt/data/from_ns")
        gv.commands.run("echo from gvisor > /mnt/data/from_gvisor")
        assert gv.commands.run("cat /mnt/data/from_ns").stdout == "from ns\n"
        assert ns.commands.run("cat /mnt/data/from_gvisor").stdout == "from gvisor\n"
        # On the volume's disk, the owner is the sandbox's uid (1000), not the host uid of the
        # ns sandbox's range: that is what lets every range see it as its own.
        mnt = os.path.join(STATE, "volumes", vol.volume_id, "mnt")
        assert (os.stat(os.path.join(mnt, "from_ns")).st_uid, os.stat(os.path.join(mnt, "from_gvisor")).st_uid) == (1000, 1000)
        # A second ns sandbox alive at once has another uid range, and sees the same owners.
        ns2 = Sandbox.create(timeout=60, volume_mounts={"/v": vol})
        try:
            ranges = [int(x.commands.run("cat /proc/self/uid_map").stdout.split()[1]) for x in (ns, ns2)]
            assert ranges[0] != ranges[1], ranges
            assert owners(ns2, "/v")["from_ns"] == [1000, 1000, 0o644]
            ns2.commands.run("echo again >> /v/from_ns")
        finally:
            ns2.kill()
        mounts = [{"name": m["name"], "path": m["path"]} if isinstance(m, dict) else {"name": m.name, "path": m.path} for m in Sandbox.get_info(ns.sandbox_id).volume_mounts]
        assert mounts == [{"name": vol.name, "path": "/mnt/data"}]
        detail = httpx.get(f"{API_URL}/sandboxes/{gv.sandbox_id}", headers=HEADERS).json()
        assert detail["volumeMounts"] == [{"name": vol.name, "path": "/mnt/data"}]
        # In use: not deleted, and nothing of it lost.
        r = httpx.delete(f"{API_URL}/volumes/{vol.volume_id}", headers=HEADERS)
        assert r.status_code == 409, r.text
        assert vol.read_file("/from_ns") == "from ns\nagain\n"
    finally:
        ns.kill()
        if gv:
            gv.kill()

    third = Sandbox.create(timeout=120, volume_mounts={"/work": vol.name})
    try:
        assert owners(third, "/work") == {"from_gvisor": [1000, 1000, 0o644], "from_ns": [1000, 1000, 0o644], "seed": [1000, 1000, 0o755]}
        assert third.commands.run("cat /work/from_ns /work/from_gvisor /work/seed/hello.txt").stdout == "from ns\nagain\nfrom gvisor\nfrom the api"
    finally:
        third.kill()
    info = vol.get_info("/from_gvisor")
    assert (info.uid, info.gid, info.size) == (1000, 1000, len("from gvisor\n"))
    assert vol.read_file("/from_gvisor") == "from gvisor\n"


def test_the_control_plane_answers_as_e2b(volume):
    vol = volume
    assert Volume.get_info(vol.volume_id).name == vol.name
    assert vol.name in [v.name for v in Volume.list()]
    r = httpx.post(f"{API_URL}/volumes", headers=HEADERS, json={"name": vol.name})
    assert (r.status_code, r.json()["message"]) == (400, f"Volume with name '{vol.name}' already exists")
    r = httpx.post(f"{API_URL}/volumes", headers=HEADERS, json={"name": "no/slash"})
    assert (r.status_code, r.json()["message"]) == (400, "Invalid volume name")
    assert httpx.get(f"{API_URL}/volumes/not-a-uuid", headers=HEADERS).status_code == 400
    assert httpx.get(f"{API_URL}/volumes/{uuid.uuid4()}", headers=HEADERS).status_code == 404
    # The content API takes the volume's token, never the API key, and one volume's token
    # opens no other.
    url = f"{API_URL}/volumecontent/{vol.volume_id}/dir?path=/"
    assert httpx.get(url, headers=HEADERS).status_code == 401
    other = Volume.create(f"t-{uuid.uuid4().hex[:12]}")
    try:
        r = httpx.get(url, headers={"Authorization": f"Bearer {other.token}"})
        assert r.status_code == 401 and isinstance(r.json()["code"], str), r.text
    finally:
        assert Volume.destroy(other.volume_id)
    assert httpx.get(url, headers={"Authorization": f"Bearer {vol.token}"}).status_code == 200
    # Paths are normalised, directories are made with parents on force, a write without force
    # does not replace.
    vol.make_dir("/a/b/c", force=True)
    vol.write_file("/a/b/c/../f.txt", "one")
    with pytest.raises(Exception):
        vol.write_file("/a/b/f.txt", "two")
    vol.write_file("/a/b/f.txt", "two", force=True)
    assert vol.read_file("/a/b/f.txt") == "two"
    assert vol.exists("/a/b/c") and not vol.exists("/nothing")
    vol.remove("/a")
    assert not vol.exists("/a/b/f.txt")


def test_bad_mounts_get_e2bs_400s(volume):
    def create(mounts):
        return httpx.post(f"{API_URL}/sandboxes", headers=HEADERS, json={"templateID": "base", "volumeMounts": mounts}, timeout=60)

    before = len(httpx.get(f"{API_URL}/v2/sandboxes", headers=HEADERS).json())
    for mounts, says in [
        ([{"name": "no-such-volume-here", "path": "/data"}], "volume mount #0: volume 'no-such-volume-here' not found"),
        ([{"name": volume.name, "path": "data"}], "volume mount #0: path must be absolute"),
        ([{"name": volume.name, "path": "/a/../etc"}], "volume mount #0: path must not contain any '.' or '..' components"),
        ([{"name": volume.name, "path": "/data"}, {"name": volume.name, "path": "/data"}], "volume mount #1: path '/data' is already used"),
        ([{"name": volume.name, "path": "/proc/x"}], "volume mount #0: path '/proc/x' is under /proc"),
    ]:
        r = create(mounts)
        assert r.status_code == 400, r.text
        assert r.json()["message"].startswith("invalid mounts:\n\t- "), r.text
        assert says in r.json()["message"], r.text
    # No half-made sandbox, and the volume is free again (deletable).
    assert len(httpx.get(f"{API_URL}/v2/sandboxes", headers=HEADERS).json()) == before


def test_symlinks_planted_inside_reach_nothing_outside(volume, tmp_path):
    vol = volume
    # A host file the links point at, by its full host path and relatively.
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    secret.chmod(0o600)
    outside = tmp_path / "dir"
    outside.mkdir()
    sbx = Sandbox.create(timeout=120, volume_mounts={"/mnt/v": vol})
    try:
        sbx.commands.run(
            f"cd /mnt/v && ln -s {secret} abs && ln -s ../../../../../../../../..{secret} rel && ln -s {outside} dir "
            f"&& ln -s /etc out_etc && mkfifo fifo && echo ok"
        )
    finally:
        sbx.kill()
    # Each link resolves inside the volume, where nothing of that name exists.
    for name in ["abs", "rel"]:
        assert vol.get_info(f"/{name}").type.value == "symlink"
        with pytest.raises(VolumePathNotFoundException):
            vol.read_file(f"/{name}")
    with pytest.raises(VolumePathNotFoundException):
        vol.read_file("/../../../../etc/hostname")
    # Through a link to a directory outside: writes, directories, metadata and removals land
    # nowhere on the host.
    for op in [
        lambda: vol.write_file("/dir/planted", "x", force=True),
        lambda: vol.make_dir("/dir/newdir", force=True),
        lambda: vol.write_file("/out_etc/cordon-planted", "x"),
        lambda: vol.update_metadata("/abs", mode=0o777),
        lambda: vol.remove("/out_etc/hostname"),
    ]:
        try:
            op()
        except Exception:
            pass
    assert not os.path.exists("/etc/cordon-planted")
    assert os.path.exists("/etc/hostname")
    assert os.listdir(outside) == []
    assert secret.read_text() == "host secret" and (secret.stat().st_mode & 0o777) == 0o600
    # The volume's own file of that path is what a link names.
    vol.make_dir(str(secret.parent), force=True)
    vol.write_file(str(secret), "the volume's own")
    assert vol.read_file("/abs") == "the volume's own"
    # A fifo is refused at once, never read (which would block the server's thread).
    r = httpx.get(f"{API_URL}/volumecontent/{vol.volume_id}/file", params={"path": "/fifo"}, headers={"Authorization": f"Bearer {vol.token}"}, timeout=10)
    assert r.status_code == 400 and r.json()["code"] == "not_regular_file", r.text
    # Removing a link removes the link, not what it names.
    vol.remove("/dir")
    assert outside.is_dir()


def host_used(path):
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_full_volume_is_enospc_inside_and_costs_the_host_its_cap_only():
    name = f"t-small-{uuid.uuid4().hex[:8]}"
    cap = 32 << 20
    subprocess.run([CORDON, "volume", "create", name, "--size", "32M"], check=True, capture_output=True)
    try:
        before = host_used(STATE)
        sbx = Sandbox.create(timeout=120, volume_mounts={"/data": name})
        try:
            r = sbx.commands.run("dd if=/dev/urandom of=/data/fill bs=1M count=200; echo rc=$?", timeout=60)
            assert "No space left on device" in r.stdout + r.stderr, r
            written = int(sbx.commands.run("stat -c %s /data/fill").stdout)
            assert 8 << 20 < written <= cap, written
            # The sandbox's own disk is untouched by it and still writable.
            sbx.commands.run("echo still > /tmp/ok && cat /tmp/ok")
        finally:
            sbx.kill()
        grown = host_used(STATE) - before
        # The image grew by what was written, never past its cap (plus ext4's own metadata).
        assert grown <= cap + (4 << 20), (grown, cap)
        # Through the API too: the upload fails and leaves no partial file.
        vol = Volume.connect(json.loads(subprocess.run([CORDON, "volume", "inspect", name], check=True, capture_output=True).stdout)["id"])
        with pytest.raises(Exception, match="no space left on the volume"):
            vol.write_file("/more", os.urandom(4 << 20))
        assert not vol.exists("/more")
    finally:
        subprocess.run([CORDON, "volume", "rm", name], check=True, capture_output=True)


def test_a_refused_upload_gets_its_answer_and_the_next_call_works(volume):
    # Refused before its body is read (the path is the volume's root, a directory), with a body
    # larger than the sockets' buffers: the server reads the rest before it answers, so the
    # client's pool never holds a connection the server is closing under it.
    for _ in range(20):
        with pytest.raises(Exception, match="directory"):
            volume.write_file("/", os.urandom(4 << 20))
        assert not volume.exists("/more")


def test_a_damaged_image_is_named_and_the_others_keep_working(volume):
    broken = Volume.create(f"t-broken-{uuid.uuid4().hex[:8]}")
    try:
        image = os.path.join(STATE, "volumes", broken.volume_id, "fs.ext4")
        # A new volume is not mounted until used: its superblock can be wiped from outside.
        with open(image, "r+b") as f:
            f.seek(1024)
            f.write(b"\0" * 4096)
        r = httpx.post(f"{API_URL}/sandboxes", headers=HEADERS, json={"templateID": "base", "volumeMounts": [{"name": broken.name, "path": "/data"}]}, timeout=60)
        assert r.status_code == 400 and f"volume '{broken.name}' is damaged" in r.text, r.text
        r = httpx.get(f"{API_URL}/volumecontent/{broken.volume_id}/dir", params={"path": "/"}, headers={"Authorization": f"Bearer {broken.token}"})
        assert r.status_code == 500 and broken.name in r.json()["message"], r.text
        # The other volume is untouched.
        volume.write_file("/ok", "fine")
        sbx = Sandbox.create(timeout=60, volume_mounts={"/data": volume})
        try:
            assert sbx.commands.run("cat /data/ok").stdout == "fine"
        finally:
            sbx.kill()
    finally:
        assert Volume.destroy(broken.volume_id)


def test_mounts_survive_pause_and_resume_and_hold_the_volume(volume):
    sbx = Sandbox.create(timeout=120, volume_mounts={"/data": volume})
    try:
        sbx.commands.run("echo before > /data/f")
        assert sbx.pause()
        # Paused, it still holds the volume.
        assert httpx.delete(f"{API_URL}/volumes/{volume.volume_id}", headers=HEADERS).status_code == 409
        sbx = Sandbox.connect(sbx.sandbox_id)
        assert sbx.commands.run("cat /data/f && echo after >> /data/f && cat /data/f").stdout == "before\nbefore\nafter\n"
        detail = httpx.get(f"{API_URL}/sandboxes/{sbx.sandbox_id}", headers=HEADERS).json()
        assert detail["volumeMounts"] == [{"name": volume.name, "path": "/data"}]
    finally:
        sbx.kill()
    assert volume.read_file("/f") == "before\nafter\n"


def test_a_fork_mounts_the_source_s_volumes(volume):
    sbx = Sandbox.create(timeout=120, volume_mounts={"/data": volume})
    try:
        sbx.commands.run("echo from the source > /data/src && echo private > /home/user/own")
        (fork,) = sbx.fork(timeout=60)
        try:
            assert not isinstance(fork, Exception), fork
            detail = httpx.get(f"{API_URL}/sandboxes/{fork.sandbox_id}", headers=HEADERS).json()
            assert detail["volumeMounts"] == [{"name": volume.name, "path": "/data"}]
            # The volume is the same one, not a copy: writes cross both ways.
            fork.commands.run("echo from the fork > /data/fork")
            assert sbx.commands.run("cat /data/fork").stdout == "from the fork\n"
            assert fork.commands.run("cat /data/src /home/user/own").stdout == "from the source\nprivate\n"
        finally:
            fork.kill()
    finally:
        sbx.kill()
    assert volume.read_file("/fork") == "from the fork\n"


@needs_runsc
def test_a_gvisor_pause_to_disk_restores_its_volume(volume):
    sbx = create_gvisor(volumeMounts=[{"name": volume.name, "path": "/data"}])
    try:
        # A process holding a file on the volume open across the pause.
        sbx.commands.run("echo before > /data/f")
        pid = sbx.commands.run("exec 3>>/data/f; sleep 3600", background=True).pid
        assert sbx.pause()
        raw = httpx.get(f"{API_URL}/sandboxes/{sbx.sandbox_id}", headers=HEADERS).json()
        assert (raw["state"], raw["volumeMounts"]) == ("paused", [{"name": volume.name, "path": "/data"}]), raw
        volume.write_file("/meanwhile", "written while paused")
        sbx = Sandbox.connect(sbx.sandbox_id)
        assert sbx.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
        assert sbx.commands.run("cat /data/f /data/meanwhile").stdout == "before\nwritten while paused"
        sbx.commands.run("echo after >> /data/f")
    finally:
        sbx.kill()
    assert volume.read_file("/f") == "before\nafter\n"


def test_a_paused_sandbox_holds_its_volume_across_a_server_restart():
    srv = Serve()
    srv.start()
    name = f"t-restart-{uuid.uuid4().hex[:8]}"
    vid = srv.api("POST", "/volumes", json={"name": name}).json()["volumeID"]
    try:
        sbx = Sandbox.create(timeout=120, volume_mounts={"/data": name}, **srv.sdk())
        sid = sbx.sandbox_id
        sbx.commands.run("echo before > /data/f")
        assert sbx.pause(mode="filesystem")
        srv.stop()
        srv.start()
        # The new server holds it for the paused sandbox it read back.
        r = srv.api("DELETE", f"/volumes/{vid}")
        assert r.status_code == 409, r.text
        again = Sandbox.connect(sid, **srv.sdk())
        assert again.commands.run("cat /data/f").stdout == "before\n"
        assert srv.api("GET", f"/sandboxes/{sid}").json()["volumeMounts"] == [{"name": name, "path": "/data"}]
        again.kill()
    finally:
        srv.stop()
        srv.start()
        assert srv.api("DELETE", f"/volumes/{vid}").status_code == 204
        srv.stop()


def test_a_read_only_volume_holds_against_sandbox_root():
    name = f"t-ro-{uuid.uuid4().hex[:8]}"
    subprocess.run([CORDON, "volume", "create", name, "--size", "16M"], check=True, capture_output=True)
    try:
        mnt = json.loads(subprocess.run([CORDON, "volume", "inspect", name], check=True, capture_output=True).stdout)["mountpoint"]
        with open(os.path.join(mnt, "kept"), "w") as f:
            f.write("kept")
        out = subprocess.run(
            [CORDON, "run", "--user", "root", "--volume", f"{name}:/d:ro", "--", "sh", "-c",
             "mount -o remount,rw,bind /d; echo remount=$?; echo x > /d/kept; echo write=$?; touch /d/new; echo touch=$?"],
            capture_output=True, text=True, timeout=120,
        )
        assert "remount=0" not in out.stdout and "write=0" not in out.stdout and "touch=0" not in out.stdout, out
        assert open(os.path.join(mnt, "kept")).read() == "kept" and not os.path.exists(os.path.join(mnt, "new"))
    finally:
        subprocess.run([CORDON, "volume", "rm", name], check=True, capture_output=True)
