"""Red team: what the file API and the interpreter's port do for someone who should not get it.

Through the real `e2b` SDKs and plain HTTP against `cordon serve`:
- a signed `/files` URL with a second `path`/`username` appended must not act on the second one
  (the server checked the first, the agent used to act on the last);
- the file API must act with the named user's rights: no writing through a symlink the user
  planted, no reading root's files for `user`, on every tier;
- the code interpreter's port must not run code for someone who has only the sandbox id.
"""

import base64
import time
import uuid

import httpx
import pytest
from e2b import Sandbox

from conftest import API_KEY, API_URL, BASE_URL, needs_qemu, needs_runsc


def as_root(sbx, cmd):
    return sbx.commands.run(cmd, user="root", timeout=120)


def test_a_signed_url_acts_only_on_the_signed_path_and_user(sandbox):
    sandbox.files.write("/home/user/public.txt", "public")
    as_root(sandbox, "umask 077; echo topsecret > /root/secret.txt")

    # Read: signed for /home/user/public.txt as user; the attacker appends root's file.
    down = sandbox.download_url("/home/user/public.txt", user="user")
    r = httpx.get(down)
    assert r.status_code == 200 and r.content == b"public", r.text
    for extra in ["&path=/root/secret.txt&username=root", "&pa%74h=/root/secret.txt", "&username=root&username=user"]:
        r = httpx.get(down + extra)
        assert r.status_code == 400, (extra, r.status_code, r.text)
        assert b"topsecret" not in r.content
        assert "Invalid format for parameter" in r.json()["message"], r.text

    # Write: signed for a file in the user's home; the attacker appends a sudoers drop-in.
    up = sandbox.upload_url("/home/user/up.txt", user="user", use_signature_expiration=60)
    r = httpx.post(up + "&path=/etc/sudoers.d/zz-pwned&username=root", files={"file": ("x", b"ALL ALL=(ALL) NOPASSWD: ALL\n")})
    assert r.status_code == 400, r.text
    assert as_root(sandbox, "test -e /etc/sudoers.d/zz-pwned && echo present || echo absent").stdout.strip() == "absent"
    r = httpx.post(up, files={"file": ("x", b"legit")})
    assert r.status_code == 200, r.text
    assert sandbox.files.read("/home/user/up.txt") == "legit"

    # A URL signed for the default user cannot be turned into root with Basic auth.
    down = sandbox.download_url("/root/secret.txt")
    r = httpx.get(down, headers={"Authorization": "Basic " + base64.b64encode(b"root:").decode()})
    assert r.status_code != 200 and b"topsecret" not in r.content, (r.status_code, r.text)


def create_on(tier, timeout):
    r = httpx.post(
        f"{API_URL}/sandboxes",
        headers={"X-API-KEY": API_KEY},
        json={"templateID": "base", "tier": tier, "timeout": timeout, "metadata": {"suite": "cordon"}},
        timeout=600,
    )
    assert r.status_code == 201, r.text
    return Sandbox.connect(r.json()["sandboxID"])


TIERS = [
    pytest.param("ns", id="ns"),
    pytest.param("gvisor", id="gvisor", marks=needs_runsc),
    pytest.param("vm", id="vm", marks=needs_qemu),
]


@pytest.mark.parametrize("tier", TIERS)
def test_the_file_api_acts_with_the_users_rights(tier):
    sbx = create_on(tier, 600)
    try:
        before = as_root(sbx, "stat -c '%U:%G %a' /etc/shadow; sha256sum /etc/shadow").stdout
        as_root(sbx, "umask 077; echo topsecret > /root/secret.txt")
        # The user plants a symlink in their home, then asks the file API to write "their" file.
        sbx.commands.run("ln -s /etc/shadow /home/user/notes.txt")
        with pytest.raises(Exception) as e:
            sbx.files.write("/home/user/notes.txt", "user::0:0:99999:7:::\n")
        assert "ermission denied" in str(e.value), e.value
        with pytest.raises(Exception):
            sbx.files.write("/etc/cron.d/pwned", "x")
        after = as_root(sbx, "stat -c '%U:%G %a' /etc/shadow; sha256sum /etc/shadow").stdout
        assert after == before, (before, after)
        assert not sbx.files.exists("/etc/cron.d/pwned")
        # Reads of root's files for `user`.
        for path in ["/etc/shadow", "/root/secret.txt", "/home/user/notes.txt"]:
            with pytest.raises(Exception) as e:
                sbx.files.read(path)
            assert "topsecret" not in str(e.value)
        with pytest.raises(Exception):
            sbx.files.list("/root")
        # Removing, moving and making what only root may.
        with pytest.raises(Exception):
            sbx.files.remove("/etc/hostname")
        with pytest.raises(Exception):
            sbx.files.rename("/etc/hostname", "/home/user/hostname")
        with pytest.raises(Exception):
            sbx.files.make_dir("/etc/pwned.d")
        assert as_root(sbx, "test -e /etc/hostname && ! test -e /etc/pwned.d && echo ok").stdout.strip() == "ok"
        # The same calls for root, and the user's own files, still work.
        assert sbx.files.read("/root/secret.txt", user="root").strip() == "topsecret"
        sbx.files.write("/home/user/mine/a.txt", "mine")
        info = sbx.files.get_info("/home/user/mine/a.txt")
        assert (info.owner, info.group) == ("user", "user"), info
        # (os.stat: coreutils' statx flags are refused by gVisor.)
        owner = "import os; s = os.stat('/home/user/mine'); print(s.st_uid, s.st_gid)"
        assert sbx.commands.run(f'python3 -c "{owner}"').stdout.split() == ["1000", "1000"]
    finally:
        sbx.kill()



def test_the_interpreter_port_runs_code_only_with_the_token():
    from e2b_code_interpreter import Sandbox as CodeSandbox

    sbx = CodeSandbox.create(timeout=600, request_timeout=0, metadata={"suite": "cordon"})
    try:
        sid = sbx.sandbox_id
        marker = f"/tmp/pwned-{uuid.uuid4().hex}"
        code = f"open({marker!r}, 'w').write('ran')"
        attempts = [
            ({"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999"}, BASE_URL),
            ({"Host": f"49999-{sid}.localhost"}, BASE_URL),
            ({"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999", "X-Access-Token": "0" * 64}, BASE_URL),
        ]
        for headers, base in attempts:
            r = httpx.post(base + "/execute", headers=headers, json={"code": code}, timeout=60)
            assert r.status_code == 401, (headers, r.status_code, r.text)
            r = httpx.post(base + "/contexts", headers=headers, json={}, timeout=60)
            assert r.status_code == 401, (headers, r.status_code, r.text)
        time.sleep(1)
        assert not sbx.files.exists(marker), "code ran without the token"
        # The official SDK (X-Access-Token on /execute, the traffic token on the context calls)
        # still does everything.
        ctx = sbx.create_code_context()
        assert sbx.run_code("6 * 7", context=ctx).text == "42"
        assert any(c.id == ctx.id for c in sbx.list_code_contexts())
        sbx.restart_code_context(ctx)
        sbx.remove_code_context(ctx)
        assert sbx.run_code("1 + 1").text == "2"
    finally:
        sbx.kill()
