"""The code interpreter: the real `e2b-code-interpreter` package against `cordon serve`, with the
`code-interpreter-v1` image (run.sh starts the server with --prebuild code-interpreter-v1, as a
build on first use takes longer than the SDK's window of retries). One sandbox serves every test that only touches its own context; the memory bomb gets a
context of its own in it, and a sandbox of its own only where it must."""

import base64
import io
import time

import pytest
from e2b import NotFoundException, SandboxException, TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox
from e2b_code_interpreter.models import Context
from PIL import Image

TEMPLATE = "code-interpreter-v1"


@pytest.fixture(scope="module")
def ci():
    # request_timeout=0: the first create on a machine builds the image, for minutes.
    sbx = Sandbox.create(timeout=900, request_timeout=0, envs={"FROM_CREATE": "sandbox-level"}, metadata={"suite": "cordon"})
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture(scope="module")
def shared_ctx(ci):
    """One context for the tests that only use their own names in it (a kernel start costs
    seconds on a busy machine)."""
    c = ci.create_code_context()
    yield c
    ci.remove_code_context(c)


@pytest.fixture
def ctx(ci):
    """A context of its own, for a test that restarts or kills its kernel."""
    c = ci.create_code_context()
    try:
        yield c
    finally:
        try:
            ci.remove_code_context(c)
        except NotFoundException:
            pass


def test_stdout_and_last_value(ci):
    ex = ci.run_code("print('hello from the kernel')\n6 * 7")
    assert ex.error is None, ex.error
    assert ex.logs.stdout == ["hello from the kernel\n"]
    assert ex.logs.stderr == []
    assert ex.text == "42"
    [main] = [r for r in ex.results if r.is_main_result]
    assert main.text == "42"
    assert isinstance(ex.execution_count, int) and ex.execution_count >= 1
    # A string's repr loses its quotes, as E2B's server does it.
    assert ci.run_code("'plain'").text == "plain"


def test_state_persists_and_counts(ci, shared_ctx):
    ctx = shared_ctx
    first = ci.run_code("counter = 10", context=ctx)
    assert first.error is None and first.results == []
    second = ci.run_code("counter += 5\ncounter", context=ctx)
    assert second.text == "15"
    assert second.execution_count == first.execution_count + 1


def test_exception_gives_error_with_traceback(ci, shared_ctx):
    ctx = shared_ctx
    ex = ci.run_code("def divide(a, b):\n    return a / b\n\nprint('before')\ndivide(1, 0)", context=ctx)
    assert ex.error is not None
    assert ex.error.name == "ZeroDivisionError"
    assert ex.error.value == "division by zero"
    tb = ex.error.traceback
    assert "ZeroDivisionError" in tb and "divide(1, 0)" in tb and "return a / b" in tb, tb
    assert "\x1b[" not in tb, "tracebacks come without terminal colours"
    assert ex.logs.stdout == ["before\n"]
    assert ex.text is None
    # An error is not sticky: the next cell runs normally.
    assert ci.run_code("'ok'", context=ctx).error is None
    custom = ci.run_code("class Oops(Exception):\n    pass\nraise Oops('custom text')", context=ctx).error
    assert (custom.name, custom.value) == ("Oops", "custom text")


def _png(result):
    raw = base64.b64decode(result.png, validate=True)
    img = Image.open(io.BytesIO(raw))
    img.load()  # decodes every pixel: a truncated or corrupt PNG fails here
    return img


def test_matplotlib_figure_is_a_png_of_its_size(ci, shared_ctx):
    ctx = shared_ctx
    code = (
        "import matplotlib.pyplot as plt\n"
        "fig = plt.figure(figsize=(4, 3), dpi=100)\n"
        "plt.plot([1, 3, 2], label='series')\n"
        "plt.title('cordon')\n"
        "plt.legend()\n"
        "plt.show()\n"
    )
    ex = ci.run_code(code, context=ctx)
    assert ex.error is None, ex.error
    pngs = [r for r in ex.results if r.png]
    assert len(pngs) == 1, ex.results
    img = _png(pngs[0])
    assert img.format == "PNG" and img.size == (400, 300)
    assert not pngs[0].is_main_result, "a figure is display data, not the cell's value"
    # Not a blank canvas: the line and the text put more than a handful of colours in it.
    assert len(img.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 10
    # A figure left open at the end of a cell is shown too, with matplotlib's default size.
    ex = ci.run_code("plt.figure()\nplt.bar(['a', 'b'], [3, 5]);", context=ctx)
    [png] = [r for r in ex.results if r.png]
    assert _png(png).size == (640, 480)


def test_dataframe_has_html_and_text(ci, shared_ctx):
    ctx = shared_ctx
    ex = ci.run_code("import pandas as pd\npd.DataFrame({'city': ['Oslo', 'Lima'], 'temp': [3, 19]})", context=ctx)
    assert ex.error is None, ex.error
    [main] = ex.results
    assert main.is_main_result
    assert "<table" in main.html and "Oslo" in main.html and "dataframe" in main.html
    assert "Lima" in main.text and "temp" in main.text
    assert set(main.formats()) >= {"text", "html"}


def test_other_mime_types_and_display_calls(ci, shared_ctx):
    ctx = shared_ctx
    code = (
        "from IPython.display import display, Markdown, SVG, JSON, Latex\n"
        "display(Markdown('**bold**'))\n"
        "display(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"4\" height=\"4\"/>'))\n"
        "display({'application/x-custom': 'c', 'text/plain': 'custom'}, raw=True)\n"
        "display(Latex(r'$x^2$'))\n"
        "JSON({'k': [1, 2]})\n"
    )
    ex = ci.run_code(code, context=ctx)
    assert ex.error is None, ex.error
    md, svg, custom, latex, main = ex.results
    assert md.markdown == "**bold**" and not md.is_main_result
    assert svg.svg.startswith("<svg")
    assert custom.extra == {"application/x-custom": "c"} and custom.text == "custom"
    assert latex.latex == "$x^2$"
    assert main.is_main_result and main.json == {"k": [1, 2]}


def test_callbacks_fire_while_the_cell_runs(ci, shared_ctx):
    ctx = shared_ctx
    seen = []
    code = (
        "import time\n"
        "from IPython.display import display, Markdown\n"
        "print('first', flush=True)\n"
        "display(Markdown('early'))\n"
        "time.sleep(2)\n"
        "print('second', flush=True)\n"
        "'done'\n"
    )
    started = time.monotonic()
    ex = ci.run_code(
        code,
        context=ctx,
        on_stdout=lambda m: seen.append(("stdout", m.line, time.monotonic())),
        on_result=lambda r: seen.append(("result", r.markdown or r.text, time.monotonic())),
    )
    ended = time.monotonic()
    assert ex.error is None, ex.error
    assert [(k, v) for k, v, _ in seen] == [("stdout", "first\n"), ("result", "early"), ("stdout", "second\n"), ("result", "done")]
    first_out, early, second_out, _ = (t for _, _, t in seen)
    # The first output and the display arrived while the cell was still sleeping.
    assert ended - first_out >= 1.5, (started, seen, ended)
    assert ended - early >= 1.5, (started, seen, ended)
    assert second_out - first_out >= 1.5


def test_contexts_do_not_share_state(ci):
    a = ci.create_code_context()
    b = ci.create_code_context(cwd="/tmp")
    try:
        assert a.language == "python" and a.cwd == "/home/user" and b.cwd == "/tmp"
        ids = {c.id for c in ci.list_code_contexts()}
        assert {a.id, b.id} <= ids
        assert ci.run_code("secret = 'only in a'", context=a).error is None
        err = ci.run_code("secret", context=b).error
        assert err is not None and err.name == "NameError"
        assert ci.run_code("secret", context=a).text == "only in a"
        assert ci.run_code("import os\nos.getcwd()", context=b).text == "/tmp"
        # Nor with the default context.
        assert ci.run_code("secret").error.name == "NameError"
    finally:
        ci.remove_code_context(a)
        ci.remove_code_context(b.id)
    ids = {c.id for c in ci.list_code_contexts()}
    assert a.id not in ids and b.id not in ids
    with pytest.raises(NotFoundException):
        ci.run_code("1", context=a)
    with pytest.raises(NotFoundException):
        ci.remove_code_context(a)


def test_restart_clears_state(ci, ctx):
    ci.run_code("kept = 3", context=ctx)
    assert ci.run_code("kept", context=ctx).text == "3"
    ci.restart_code_context(ctx)
    err = ci.run_code("kept", context=ctx).error
    assert err is not None and err.name == "NameError"
    assert ci.run_code("1 + 1", context=ctx).text == "2"
    with pytest.raises(NotFoundException):
        ci.restart_code_context("no-such-context")


def test_timeout_interrupts_the_cell_and_keeps_the_context(ci, shared_ctx):
    ctx = shared_ctx
    ci.run_code("survivor = 'still here'", context=ctx)
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        ci.run_code("while True:\n    pass", context=ctx, timeout=2)
    assert time.monotonic() - started < 10
    # The disconnect interrupted the loop (KeyboardInterrupt): the kernel and its state live on.
    ex = ci.run_code("survivor", context=ctx, timeout=30)
    assert ex.error is None and ex.text == "still here"


def test_a_cell_that_ignores_interrupts_gets_a_fresh_kernel(ci, ctx):
    ci.run_code("doomed = 1", context=ctx)
    with pytest.raises(TimeoutException):
        ci.run_code("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass", context=ctx, timeout=2)
    # The server restarts a kernel that does not stop within its grace period; the next cell
    # waits for that, then runs.
    ex = ci.run_code("2 + 2", context=ctx, timeout=60)
    assert ex.text == "4"
    assert ci.run_code("doomed", context=ctx).error.name == "NameError"


def test_memory_bomb_kills_the_kernel_not_the_sandbox(ci, ctx):
    # Decided behaviour: the sandbox's memory cap applies to the kernel like to any process; the
    # OOM killer takes the kernel (the biggest process), the cell reports `KernelDied`, the
    # context gets a fresh kernel, and the sandbox and its other contexts carry on.
    ci.run_code("default_marker = 'alive'")
    ci.run_code("lost = 1", context=ctx)
    ex = ci.run_code("blocks = []\nwhile True:\n    blocks.append(b'x' * (32 << 20))", context=ctx, timeout=120)
    assert ex.error is not None
    assert ex.error.name == "KernelDied", ex.error
    assert "memory" in ex.error.value
    assert ci.run_code("1 + 1", context=ctx).text == "2"
    assert ci.run_code("lost", context=ctx).error.name == "NameError"
    assert ci.run_code("default_marker").text == "alive"
    assert ci.commands.run("echo usable").stdout == "usable\n"


def test_env_vars_per_run_and_from_create(ci, shared_ctx):
    ctx = shared_ctx
    code = "import os\nprint(os.environ.get('RUN_VAR'), os.environ.get('FROM_CREATE'))"
    ex = ci.run_code(code, context=ctx, envs={"RUN_VAR": "for this run"})
    assert ex.logs.stdout == ["for this run sandbox-level\n"]
    # Only for that run; and a run's variable can shadow a sandbox-level one for that run only.
    assert ci.run_code(code, context=ctx).logs.stdout == ["None sandbox-level\n"]
    ex = ci.run_code(code, context=ctx, envs={"FROM_CREATE": "shadowed"})
    assert ex.logs.stdout == ["None shadowed\n"]
    assert ci.run_code(code, context=ctx).logs.stdout == ["None sandbox-level\n"]
    # Child processes of the cell see them too.
    ex = ci.run_code("import subprocess\nprint(subprocess.run(['sh', '-c', 'echo $RUN_VAR'], capture_output=True, text=True).stdout, end='')", context=ctx, envs={"RUN_VAR": "inherited"})
    assert ex.logs.stdout == ["inherited\n"]


def test_bad_requests_are_clear(ci):
    with pytest.raises(SandboxException, match="not available"):
        ci.run_code("1", language="r")
    with pytest.raises(NotFoundException):
        ci.run_code("1", context=Context(context_id="no-such-context", language="python", cwd="/"))
    with pytest.raises(SandboxException, match="not a directory"):
        ci.create_code_context(cwd="/no/such/dir")
    # Languages are matched like the SDK names them.
    assert ci.run_code("3", language=" Python ").text == "3"


def test_kernel_is_confined_like_any_process(ci):
    code = (
        "import os, socket, ctypes\n"
        "print(os.getuid(), os.getgid())\n"
        "try:\n"
        "    socket.create_connection(('198.51.100.7', 80), timeout=3)\n"
        "    print('connected')\n"
        "except OSError as e:\n"
        "    print('no network:', e.errno)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x20000), ctypes.get_errno())\n"  # CLONE_NEWNS
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
    )
    ex = ci.run_code(code)
    assert ex.error is None, ex.error
    uid, net, unshare, capeff = "".join(ex.logs.stdout).splitlines()
    assert uid == "1000 1000"
    assert net.startswith("no network:"), net
    assert unshare.startswith("unshare -1"), unshare
    assert int(capeff, 16) == 0


def test_ready_when_create_returns():
    # No retries, no sleeps: the first request after create must find the interpreter up.
    started = time.monotonic()
    sbx = Sandbox.create(timeout=120, request_timeout=0, metadata={"suite": "cordon"})
    try:
        ex = sbx.run_code("1 + 1")
        assert ex.text == "2", ex
        assert time.monotonic() - started < 60
        # The interpreter is the image's start command, visible as a process like in E2B.
        tags = [p.tag for p in sbx.commands.list()]
        assert "start" in tags, tags
    finally:
        sbx.kill()


async def test_async_sdk_against_the_same_sandbox(ci):
    sbx = await AsyncSandbox.connect(ci.sandbox_id)
    lines = []

    async def on_stdout(msg):
        lines.append(msg.line)

    ex = await sbx.run_code("for i in range(3):\n    print(i)\nsum(range(4))", on_stdout=on_stdout)
    assert ex.text == "6"
    assert "".join(lines) == "0\n1\n2\n"
    ctx = await sbx.create_code_context()
    assert (await sbx.run_code("z = 5\nz * 2", context=ctx)).text == "10"
    await sbx.remove_code_context(ctx)
