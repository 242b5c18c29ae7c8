"""E2B template builds through `cordon serve` with the real SDK's `Template()` builder: the
upload handshake, the build itself (each RUN in a sandbox, each step a cached layer), its status
and logs, a failing step named as the SDK maps it back to the builder call, `exists`, tags, and
sandboxes created from the built template with its start command running and its ready command
passed before the create returns."""

import os
import secrets
import time

import pytest
from e2b import BuildException, Sandbox, Template, wait_for_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cordon serve needs root")


@pytest.fixture
def context(tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    (app / "hello.py").write_text("print('hello from the template')\n")
    (app / "data.txt").write_text("some data\n")
    (tmp_path / "single.txt").write_text("one file\n")
    return tmp_path


NAMES = []


def name(tag):
    n = f"tpl-{tag}-{secrets.token_hex(4)}"
    NAMES.append(n)
    return n


@pytest.fixture(scope="module", autouse=True)
def delete_templates():
    """Removes every template these tests made (their images and uploads), so that runs do not
    pile them up in the suite's state dir."""
    yield
    import httpx

    for n in NAMES:
        r = httpx.delete(f"{os.environ['E2B_API_URL']}/templates/{n}", headers={"X-API-KEY": os.environ["E2B_API_KEY"]})
        assert r.status_code in (204, 404), (n, r.status_code, r.text)


def wait_for(info, limit=300):
    """Polls a background build to its end, as the SDK's own wait does; returns the last
    status and every log entry seen."""
    deadline = time.monotonic() + limit
    offset, entries = 0, []
    while True:
        st = Template.get_build_status(info, logs_offset=offset)
        offset += len(st.log_entries)
        entries += st.log_entries
        if st.status.value in ("ready", "error") or time.monotonic() > deadline:
            return st, entries
        time.sleep(0.2)


def web_template(context, token):
    return (
        Template(file_context_path=str(context))
        .from_template("base")
        .copy("app", "/home/user/app")
        .copy("single.txt", "/opt/single.txt")
        .run_cmd(f"echo {token} > /home/user/app/token && whoami > /home/user/app/built-by")
        .run_cmd("apt-get --version > /dev/null && id -u > /opt/root-step", user="root")
        .set_envs({"GREETING": "hi"})
        .run_cmd('echo "$GREETING" > /home/user/app/greeting')
        .set_workdir("/home/user/app")
        .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))
    )


def test_a_built_template_runs_its_files_steps_and_start_command(context):
    token = secrets.token_hex(8)
    tpl = name("web")
    logs = []
    info = Template.build(web_template(context, token), tpl, on_build_logs=logs.append)
    assert info.template_id and info.build_id
    assert any("RUN" in e.message for e in logs), [e.message for e in logs]

    assert Template.exists(tpl)
    assert not Template.exists(name("absent"))
    assert Template.exists("base")

    sbx = Sandbox.create(tpl)
    try:
        r = sbx.commands.run("pwd; cat token built-by greeting /opt/single.txt /opt/root-step; python3 hello.py; stat -c %U hello.py /home/user/app")
        assert r.stdout.split("\n")[:6] == ["/home/user/app", token, "user", "hi", "one file", "0"], r.stdout
        assert "hello from the template" in r.stdout
        # Copied files belong to `user`, as E2B's copy makes them.
        assert r.stdout.rstrip().endswith("user\nuser"), r.stdout
        # The start command is running, and its port answered before the create returned.
        r = sbx.commands.run("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/hello.py")
        assert r.stdout == "200", r.stdout
    finally:
        sbx.kill()


def test_an_unchanged_rebuild_is_cached_and_a_failing_step_is_named(context):
    token = secrets.token_hex(8)
    tpl = name("cache")
    t = time.monotonic()
    Template.build(web_template(context, token), tpl)
    first = time.monotonic() - t
    logs = []
    t = time.monotonic()
    Template.build(web_template(context, token), tpl, on_build_logs=logs.append)
    rebuilt = time.monotonic() - t
    cached = [e.message for e in logs if e.message == "cached"]
    assert len(cached) >= 6, [e.message for e in logs]
    assert rebuilt < first, (rebuilt, first)

    bad = (
        Template(file_context_path=str(context))
        .from_template("base")
        .run_cmd("echo fine")
        .run_cmd("echo going down; exit 7")
    )
    with pytest.raises(BuildException) as e:
        Template.build(bad, name("bad"))
    assert "exit 7" in str(e.value) and "exited with code 7" in str(e.value), str(e.value)


def test_build_in_background_then_polling_reports_status_logs_and_the_failing_step(context):
    # A RUN step has loopback only: no API field opens its network (the operator's
    # --build-allow-net does).
    good = (
        Template(file_context_path=str(context))
        .from_template("base")
        .run_cmd(f"echo {secrets.token_hex(4)} > /tmp/x")
        .run_cmd("[ \"$(ip -o link | cut -d: -f2 | tr -d ' ')\" = lo ]")
    )
    st, entries = wait_for(Template.build_in_background(good, name("bg")))
    assert st.status.value == "ready", st
    assert any("echo" in e.message for e in entries)

    bad = Template(file_context_path=str(context)).from_template("base").run_cmd("true").run_cmd("false")
    st, _ = wait_for(Template.build_in_background(bad, name("bgbad")))
    assert st.status.value == "error"
    # The second step, 1-based, as the SDK maps it to the second run_cmd call.
    assert st.reason.step == "2", st.reason
    assert "failed to run command 'false'" in st.reason.message


def test_a_base_the_server_does_not_have_fails_at_the_base_step(context):
    st, _ = wait_for(Template.build_in_background(Template().from_image("no-such-image-anywhere:1.0").run_cmd("true"), name("nobase")))
    assert st.status.value == "error"
    assert st.reason.step == "base", st.reason
    assert "no-such-image-anywhere" in st.reason.message


def test_tags_name_builds_and_a_tag_creates_its_build(context):
    tpl = name("tags")
    t1 = Template(file_context_path=str(context)).from_template("base").run_cmd("echo one > /home/user/v")
    Template.build(t1, f"{tpl}:v1")
    t2 = Template(file_context_path=str(context)).from_template("base").run_cmd("echo two > /home/user/v")
    Template.build(t2, f"{tpl}:v2")
    tags = {t.tag: t.build_id for t in Template.get_tags(tpl)}
    assert set(tags) >= {"v1", "v2"} and tags["v1"] != tags["v2"], tags
    Template.assign_tags(f"{tpl}:v1", ["stable"])
    for ref, want in ((f"{tpl}:v1", "one"), (f"{tpl}:stable", "one"), (f"{tpl}:v2", "two"), (tpl, "two")):
        sbx = Sandbox.create(ref)
        try:
            assert sbx.commands.run("cat /home/user/v").stdout.strip() == want, ref
        finally:
            sbx.kill()
    Template.remove_tags(tpl, ["stable"])
    assert "stable" not in {t.tag for t in Template.get_tags(tpl)}


def test_the_upload_url_is_signed(context):
    """The SDK uploads without its API key, so the URL is the credential: a changed signature,
    hash or expiry is refused."""
    import httpx

    api = os.environ["E2B_API_URL"]
    key = os.environ["E2B_API_KEY"]
    h = {"X-API-KEY": key}
    r = httpx.post(f"{api}/v3/templates", json={"name": name("upload")}, headers=h)
    assert r.status_code == 202, r.text
    tid = r.json()["templateID"]
    assert httpx.get(f"{api}/templates/{tid}/files/not-a-hash", headers=h).status_code == 400
    assert httpx.get(f"{api}/templates/nosuchtemplate/files/{'a' * 64}", headers=h).status_code == 404
    r = httpx.get(f"{api}/templates/{tid}/files/{'b' * 64}", headers=h)
    assert r.status_code == 201 and r.json()["present"] is False
    url = r.json()["url"]
    forged = url.replace("signature=", "signature=0")
    assert httpx.put(forged, content=b"x").status_code == 401
    other = url.replace("b" * 64, "c" * 64)
    assert httpx.put(other, content=b"x").status_code == 401
    assert httpx.put(url, content=b"archive").status_code == 201
    r = httpx.get(f"{api}/templates/{tid}/files/{'b' * 64}", headers=h)
    assert r.json()["present"] is True
    assert httpx.get(f"{api}/templates/{tid}/files/{'c' * 64}", headers=h).json()["present"] is False
