"""Users' own images through the API: a `docker save` archive imported and an image pulled from a
real local registry (Debian's docker-registry, filled by crates/cli/tests/images/registry.py)
become templates; their config's Env, WorkingDir and User apply to the SDK's commands, which run
through `sh` in an image without bash, and an image without any shell says so."""

import json
import os
import shutil
import signal
import subprocess
import uuid

import pytest
from e2b import CommandExitException, Sandbox

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "..", "crates", "cli", "tests", "images", "registry.py")
CORDON = os.environ.get("CORDON_BIN", "cordon")

missing = [t for t in ("umoci", "skopeo", "docker-registry", "busybox") if not shutil.which(t)]
pytestmark = pytest.mark.skipif(bool(missing) or os.geteuid() != 0, reason=f"needs root and {', '.join(missing) or 'nothing'} (scripts/install-deps)")


def cordon(*args):
    return subprocess.run([CORDON, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """The fixture's images, built once, and a registry serving them."""
    d = tmp_path_factory.mktemp("oci")
    built = subprocess.run(["python3", FIXTURE, "build-images", str(d / "images")], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    reg = subprocess.Popen(
        ["python3", FIXTURE, "serve", "--dir", str(d / "registry"), "--images", str(d / "images")],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        info = json.loads(reg.stdout.readline())
        yield {"dir": d / "images", "registry": info["registry"]}
    finally:
        os.killpg(reg.pid, signal.SIGTERM)
        reg.wait(timeout=30)


@pytest.fixture
def template(images):
    """Imports or pulls an image under a fresh name; removes it (and its layers) afterwards."""
    names = []

    def make(how):
        name = "oci-" + uuid.uuid4().hex[:10]
        if how == "docker-save":
            r = cordon("image", "import", name, str(images["dir"] / "bb-docker.tar"))
        elif how == "noshell":
            r = cordon("image", "pull", f"{images['registry']}/noshell:latest", "--name", name)
        else:
            r = cordon("image", "pull", f"{images['registry']}/bb:latest", "--name", name)
        assert r.returncode == 0, r.stderr
        names.append(name)
        return name

    yield make
    for n in names:
        cordon("image", "rm", n)
    cordon("image", "prune")


@pytest.mark.parametrize("how", ["docker-save", "pull"])
def test_image_config_applies_to_sdk_commands(template, how):
    name = template(how)
    sbx = Sandbox.create(template=name, timeout=120)
    try:
        # The SDK runs `/bin/bash -l -c ...`; the image has only busybox's sh.
        r = sbx.commands.run("echo $GREETING; pwd; id -u; test -e /bin/bash || echo no-bash")
        assert r.stdout.split() == ["hello", "/work", "1234", "no-bash"], r
        assert sbx.commands.run("id -u", user="root").stdout == "0\n"
        # Files through envd land as the image's user.
        sbx.files.write("/work/note.txt", "hi")
        assert sbx.commands.run("cat /work/note.txt; stat -c %u /work/note.txt").stdout == "hi1234\n"
        # The whiteouts of its layers hold through the API too.
        assert sbx.commands.run("ls /old /opq").stdout.split() == ["/old:", "keep.txt", "/opq:", "c.txt"]
    finally:
        sbx.kill()
    # While no sandbox uses it, it can go.
    assert cordon("image", "rm", name).returncode == 0


def test_image_in_use_is_not_removed(template):
    name = template("pull")
    sbx = Sandbox.create(template=name, timeout=120)
    try:
        r = cordon("image", "rm", name)
        assert r.returncode == 2 and "in use" in r.stderr, r
        assert sbx.commands.run("echo still").stdout == "still\n"
    finally:
        sbx.kill()


def test_image_without_shell_says_so(template):
    name = template("noshell")
    sbx = Sandbox.create(template=name, timeout=120)
    try:
        with pytest.raises(Exception) as e:
            sbx.commands.run("echo hi")
        assert "/bin/sh" in str(e.value), e.value
        assert not isinstance(e.value, CommandExitException)
    finally:
        sbx.kill()
