"""The vm tier through the API: `tier: "vm"` in the create body (a cordon extension the SDK does
not send itself), then the real SDK connects and works as with any other sandbox: commands,
files and a server inside reached through port forwarding, all over the guest agent's one
multiplexed virtio-serial link. One VM for the whole module: under TCG a boot takes seconds."""

import platform
import time

import httpx
from e2b import Sandbox

from conftest import API_KEY, API_URL, BASE_URL, needs_qemu

pytestmark = needs_qemu


def test_vm_sandbox_through_the_sdk():
    r = httpx.post(
        f"{API_URL}/sandboxes",
        headers={"X-API-KEY": API_KEY},
        json={"templateID": "base", "tier": "vm", "timeout": 300},
        timeout=300,
    )
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    sbx = Sandbox.connect(sid)
    try:
        out = sbx.commands.run("uname -r; hostname; id -u", timeout=120)
        kernel, hostname, uid = out.stdout.split()
        # The guest's own Debian kernel answers, not the host's.
        assert kernel != platform.release() and "cloud-amd64" in kernel, out.stdout
        assert (hostname, uid) == (sid, "1000")
        sbx.files.write("/home/user/www/hello.txt", "from a vm")
        assert sbx.files.read("/home/user/www/hello.txt") == "from a vm"
        sbx.commands.run("cd /home/user/www && python3 -m http.server 8080", background=True)
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8080"}
        for _ in range(300):
            r = httpx.get(BASE_URL + "/hello.txt", headers=headers, timeout=30)
            if r.status_code == 200:
                break
            time.sleep(0.2)
        assert r.status_code == 200 and r.text == "from a vm", r.text
    finally:
        sbx.kill()
    r = httpx.get(f"{API_URL}/sandboxes/{sid}", headers={"X-API-KEY": API_KEY})
    assert r.status_code == 404
