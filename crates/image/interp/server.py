#!/usr/bin/env python3
"""cordon's code interpreter service: the HTTP API of E2B's code interpreter on port 49999.

`e2b-code-interpreter` (the Python and JS SDKs) talks to this server through `cordon serve`,
which forwards the sandbox's port 49999 here. Each context is a real IPython kernel
(ipykernel) driven with jupyter_client; no Jupyter Server sits in between.

    POST   /execute               {"code", "context_id"?, "language"?, "env_vars"?}
                                  -> 200, newline-delimited JSON events (see `translate`)
    POST   /contexts              {"language"?, "cwd"?} -> {"id", "language", "cwd"}
    GET    /contexts              -> [{"id", "language", "cwd"}, ...]
    POST   /contexts/{id}/restart -> null
    DELETE /contexts/{id}         -> null
    GET    /health                -> "OK"

The server (tornado, asyncio) is the sandbox's start command: it binds its port only once
the default Python context's kernel answers, so the port being open means ready.

A client that hangs up mid-cell (the SDK's `timeout`, or any disconnect) interrupts the
kernel; a cell that ignores the interrupt gets its kernel restarted, so the context is
usable again either way. A kernel that dies (the sandbox's memory limit, say) is reported
as a `KernelDied` error and restarted.
"""

import asyncio
import datetime
import json
import logging
import os
import signal
import sys
import uuid

PORT = int(os.environ.get("CORDON_INTERP_PORT", "49999"))
HOST = "127.0.0.1"
# E2B contexts start in /home/user, which is the sandbox user's home.
DEFAULT_CWD = os.environ.get("HOME") or "/home/user"
# E2B's server sends a keepalive line after this much silence.
KEEPALIVE_SECS = 5.0
# How often a running cell's kernel is checked for being alive.
LIVENESS_SECS = 0.5
# How long an interrupted cell may take to stop before its kernel is restarted.
INTERRUPT_GRACE_SECS = 3.0
# How long a kernel may take to answer, stretched on a sandbox that runs code slower than the
# host (an emulated CPU), as cordon's own wait for this server is.
KERNEL_READY_SECS = 60.0 * max(1, int(os.environ.get("CORDON_SLOWDOWN", "1") or 1))
# What `python3 -m ipykernel_launcher` does, with debugpy made unimportable.
KERNEL_LAUNCHER = (
    "import sys; sys.modules['debugpy'] = None; "
    "from ipykernel import kernelapp; kernelapp.launch_new_instance()"
)
# Events queued for one cell before the kernel's output waits for the client.
RUN_QUEUE = 1000

log = logging.getLogger("cordon-interp")

# ---------------------------------------------------------------------------------------------
# The wire format: Jupyter messages -> NDJSON lines. Pure functions, tested without a kernel.

# Jupyter MIME type -> key of the SDK's `Result`. Everything else goes to `extra`.
MIME_KEYS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}

# Binary types, which Jupyter sends base64-encoded.
BASE64_KEYS = {"png", "jpeg", "pdf"}

# Languages the SDK may name, lower-cased and trimmed, and the kernel that runs each.
LANGUAGES = {"python": "python", "python3": "python"}


def normalize_language(language):
    """The kernel language for a request's `language`; None when this image has no kernel."""
    if language is None:
        return "python"
    if not isinstance(language, str):
        return None
    return LANGUAGES.get(language.strip().lower())


def result_line(data, is_main_result):
    """A `result` line from a MIME bundle, the way E2B's server maps it."""
    line = {"type": "result", "is_main_result": is_main_result}
    extra = {}
    for mime, value in data.items():
        key = MIME_KEYS.get(mime)
        if key is None:
            extra[mime] = value
            continue
        if key == "text" and isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == "'":
            # A string's repr: the SDK shows the string itself.
            value = value[1:-1]
        elif key in BASE64_KEYS and isinstance(value, str):
            # ipykernel ends its base64 with a newline, which strict decoders refuse.
            value = value.strip()
        line[key] = value
    if extra:
        line["extra"] = extra
    return line


def error_line(name, value, traceback):
    return {"type": "error", "name": name, "value": value, "traceback": traceback}


def timestamp(msg):
    date = msg.get("header", {}).get("date")
    if isinstance(date, datetime.datetime):
        return date.isoformat()
    if isinstance(date, str):
        return date
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def translate(msg):
    """The lines one IOPub message of a cell becomes, and whether the cell is done.

    The cell is done at the kernel's `idle` status for it: by then every output of the
    cell has been published (IOPub is ordered)."""
    kind = msg.get("msg_type") or msg.get("header", {}).get("msg_type")
    content = msg.get("content", {})
    if kind == "stream":
        name = content.get("name")
        if name in ("stdout", "stderr"):
            return [{"type": name, "text": content.get("text", ""), "timestamp": timestamp(msg)}], False
        return [], False
    if kind == "execute_input":
        return [{"type": "number_of_executions", "execution_count": content.get("execution_count")}], False
    if kind == "execute_result":
        return [result_line(content.get("data", {}), True)], False
    if kind in ("display_data", "update_display_data"):
        return [result_line(content.get("data", {}), False)], False
    if kind == "error":
        tb = content.get("traceback") or []
        return [error_line(content.get("ename", ""), content.get("evalue", ""), "\n".join(tb))], False
    if kind == "status" and content.get("execution_state") == "idle":
        return [], True
    return [], False


def env_setup_code(env_vars):
    """Code that sets `env_vars` in the kernel and remembers what it replaced."""
    return (
        "import os as _cordon_os\n"
        f"_cordon_env_saved = {{k: _cordon_os.environ.get(k) for k in {sorted(env_vars)!r}}}\n"
        f"_cordon_os.environ.update({dict(env_vars)!r})\n"
    )


ENV_RESTORE_CODE = (
    "for _cordon_k, _cordon_v in _cordon_env_saved.items():\n"
    "    if _cordon_v is None:\n"
    "        _cordon_os.environ.pop(_cordon_k, None)\n"
    "    else:\n"
    "        _cordon_os.environ[_cordon_k] = _cordon_v\n"
    "del _cordon_env_saved, _cordon_k, _cordon_v\n"
)


def check_env_vars(env_vars):
    """An error message when `env_vars` is not an object of strings, else None."""
    if env_vars is None:
        return None
    if not isinstance(env_vars, dict):
        return "env_vars must be an object of strings"
    for k, v in env_vars.items():
        if not isinstance(v, str) or not k or "=" in k or "\0" in k or "\0" in v:
            return f"env_vars: {k!r} must be a non-empty name without '=' with a string value"
    return None


def describe_death(returncode):
    """Why a kernel died, for the `KernelDied` error."""
    if returncode is not None and returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if sig == signal.SIGKILL:
            return (
                f"the kernel was killed by {name}, most likely because the sandbox ran out of "
                "memory; it was restarted and the context's variables are lost"
            )
        return f"the kernel was killed by {name}; it was restarted and the context's variables are lost"
    return f"the kernel exited (status {returncode}); it was restarted and the context's variables are lost"


# ---------------------------------------------------------------------------------------------
# Kernels.

class KernelStartError(Exception):
    pass


class Run:
    """One cell in flight: its IOPub messages, and a flag for a restart of its context."""

    def __init__(self):
        self.queue = asyncio.Queue(RUN_QUEUE)
        self.restarted = asyncio.Event()


async def first_of(*aws, timeout=None):
    """Waits until the first of some awaitables is done (or `timeout`); returns whether each is
    done, and their tasks. The others are cancelled."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, pending = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    return [t in done for t in tasks], tasks


class Context:
    """One execution context: an IPython kernel, its channels, and the cells it runs."""

    def __init__(self, language, cwd):
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.km = None
        self.kc = None
        self.runs = {}  # msg_id of an execute request -> Run
        self.replies = {}  # msg_id -> Future of its shell reply
        self.probes = {}  # msg_id of a kernel_info probe -> channels its answers came on
        self.lock = asyncio.Lock()  # one cell at a time, so env_vars cannot leak across cells
        self.tasks = []
        self.generation = 0  # bumped by every (re)start of the kernel

    def describe(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def start(self):
        from jupyter_client.manager import AsyncKernelManager

        env = {k: v for k, v in os.environ.items() if not k.startswith("CORDON_INTERP_")}
        # Jupyter's old path scheme warns on every start otherwise.
        env.setdefault("JUPYTER_PLATFORM_DIRS", "1")
        # ipykernel's debugger would warn about frozen modules on every start.
        env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        self.km = AsyncKernelManager(kernel_name="python3")
        # ipykernel_launcher, minus the debugger: no client of this API speaks DAP, and
        # importing debugpy is a sixth of the kernel's start-up CPU.
        spec = self.km.kernel_spec
        spec.argv = [spec.argv[0], "-c", KERNEL_LAUNCHER, "-f", "{connection_file}"]
        await self.km.start_kernel(cwd=self.cwd, env=env)
        self._connect()
        await self._wait_ready()

    def _connect(self):
        """New client channels to the kernel, and the tasks that read them."""
        self.kc = self.km.client()
        self.kc.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)
        self.tasks = [
            asyncio.create_task(self._pump(self.kc.iopub_channel, "iopub")),
            asyncio.create_task(self._pump(self.kc.shell_channel, "shell")),
        ]

    def _disconnect(self):
        for t in self.tasks:
            t.cancel()
        self.tasks = []
        try:
            if self.kc is not None:
                self.kc.stop_channels()
        except Exception:
            pass

    async def _pump(self, channel, name):
        """Hands each message of a channel to whoever waits for it. Only this task reads it."""
        while True:
            try:
                msg = await channel.get_msg()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a malformed message must not stop the pump
                log.warning("%s: bad message on %s: %s", self.id, name, e)
                await asyncio.sleep(0.01)
                continue
            parent = msg.get("parent_header", {}).get("msg_id")
            if parent in self.probes:
                self.probes[parent].add(name)
            if name == "iopub":
                run = self.runs.get(parent)
                if run is not None:
                    # A full queue (a client slower than the cell's output) makes the kernel's
                    # output wait here, not this server's memory grow.
                    await run.queue.put(msg)
            else:
                fut = self.replies.pop(parent, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    async def _wait_ready(self, may_restart=True, deadline=None):
        """Waits until the kernel answers a kernel_info request on the shell channel *and* its
        status for that request arrives on IOPub: only then is the IOPub subscription live, so
        no output of the first cell can be lost.

        A kernel that has not answered after a quarter of the window gets new client channels
        (a shell channel that stopped receiving replies while IOPub worked has been seen under
        emulated CPUs), and after half of it a fresh kernel process, once. Each step is logged
        with what was seen, so a start that still fails says where it stood."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        # A kernel started afresh here gets what is left of the first one's window, which is
        # what cordon's own wait for this server's port allows.
        deadline = deadline or started + KERNEL_READY_SECS
        reconnect_at = started + KERNEL_READY_SECS / 4
        restart_at = started + KERNEL_READY_SECS / 2 if may_restart else deadline
        seen = set()
        try:
            while loop.time() < deadline:
                if not self.alive():
                    raise KernelStartError(f"the kernel exited during startup: {describe_death(self.returncode())}")
                if loop.time() >= reconnect_at:
                    reconnect_at = deadline
                    log.warning("kernel %s: no answer after %.0fs (seen on: %s); reconnecting its channels",
                                self.id, loop.time() - started, ", ".join(sorted(seen)) or "nothing")
                    self._disconnect()
                    self._connect()
                if loop.time() >= restart_at:
                    log.warning("kernel %s: no answer after %.0fs (seen on: %s); starting a new kernel",
                                self.id, loop.time() - started, ", ".join(sorted(seen)) or "nothing")
                    self.probes.clear()
                    self._disconnect()
                    await self.km.restart_kernel(now=True)
                    self._connect()
                    return await self._wait_ready(may_restart=False, deadline=deadline)
                msg_id = self.kc.kernel_info()
                self.probes[msg_id] = set()
                # A probe sent before the kernel listens can be lost: send another each second.
                resend = loop.time() + 1.0
                while loop.time() < resend:
                    await asyncio.sleep(0.01)
                    for got in self.probes.values():
                        seen |= got
                    if any({"shell", "iopub"} <= got for got in self.probes.values()):
                        self.generation += 1
                        return
            raise KernelStartError(
                f"the kernel did not answer within {loop.time() - started:.0f}s (seen on: {', '.join(sorted(seen)) or 'nothing'})"
            )
        finally:
            self.probes.clear()

    def _process(self):
        provisioner = getattr(self.km, "provisioner", None) if self.km else None
        return getattr(provisioner, "process", None) if provisioner else None

    def alive(self):
        proc = self._process()
        return proc is not None and proc.poll() is None

    def returncode(self):
        proc = self._process()
        return proc.poll() if proc is not None else None

    async def _restart_kernel(self):
        """A fresh kernel process on the same ports, with new client channels: channels left to
        reconnect to the new process by themselves sometimes stopped receiving shell replies
        under the gvisor tier (IOPub kept working), so that the kernel never looked ready."""
        self._disconnect()
        await self.km.restart_kernel(now=True)
        self._connect()
        await self._wait_ready()

    async def restart(self):
        """`POST /contexts/{id}/restart`: a running cell ends with `ContextRestarting`."""
        for run in list(self.runs.values()):
            run.restarted.set()
        await self._restart_kernel()

    async def shutdown(self):
        self._disconnect()
        for run in list(self.runs.values()):
            run.restarted.set()
        try:
            if self.km is not None:
                await self.km.shutdown_kernel(now=True)
        except Exception as e:
            log.warning("%s: shutdown: %s", self.id, e)

    async def _silent(self, code):
        """Runs setup code that the client never sees and that does not count as a cell."""
        msg_id = self.kc.execute(code, silent=True, store_history=False, stop_on_error=False)
        fut = asyncio.get_running_loop().create_future()
        self.replies[msg_id] = fut
        try:
            reply = await asyncio.wait_for(fut, 30)
        finally:
            self.replies.pop(msg_id, None)
        if reply["content"].get("status") != "ok":
            log.warning("%s: setup code failed: %s", self.id, reply["content"].get("evalue"))

    async def execute(self, code, env_vars, closed):
        """Runs one cell; yields the NDJSON objects of the reply. `closed` is set once the
        client has gone away; the cell is then interrupted (and the generator still has to
        be run to its end, which the handler does)."""
        # Wait for the context's previous cell, with keepalives so that proxies keep the stream.
        acquire = asyncio.ensure_future(self.lock.acquire())
        while True:
            (got, gone), _ = await first_of(asyncio.shield(acquire), closed.wait(), timeout=KEEPALIVE_SECS)
            if got:
                break
            if gone:
                # A cancelled Lock.acquire never holds the lock.
                acquire.cancel()
                return
            yield {"type": "keepalive"}
        try:
            if not self.alive():
                rc = self.returncode()
                log.warning("%s: kernel found dead (%s), restarting it", self.id, rc)
                await self._restart_kernel()
                yield {
                    "type": "stderr",
                    "text": f"[cordon] before this cell, {describe_death(rc)}\n",
                    "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                }
            async for line in self._run(code, env_vars or {}, closed):
                yield line
        finally:
            self.lock.release()

    async def _run(self, code, env_vars, closed):
        if env_vars:
            await self._silent(env_setup_code(env_vars))
        run = Run()
        msg_id = self.kc.execute(code, silent=False, store_history=True, allow_stdin=False, stop_on_error=False)
        self.runs[msg_id] = run
        generation = self.generation
        loop = asyncio.get_running_loop()
        last_sent = loop.time()
        try:
            while True:
                (got, gone, restarted), (getter, _, _) = await first_of(
                    run.queue.get(), closed.wait(), run.restarted.wait(), timeout=LIVENESS_SECS
                )
                if got:
                    lines, finished = translate(getter.result())
                    for line in lines:
                        yield line
                        last_sent = loop.time()
                    if finished:
                        break
                    continue
                if restarted:
                    yield error_line("ContextRestarting", "the context was restarted during the execution", "")
                    break
                if gone:
                    await self._abort(run)
                    break
                if not self.alive():
                    rc = self.returncode()
                    log.warning("%s: kernel died during a cell (%s), restarting it", self.id, rc)
                    try:
                        await self._restart_kernel()
                    except Exception as e:
                        log.error("%s: cannot restart the kernel: %s", self.id, e)
                    yield error_line("KernelDied", describe_death(rc), "")
                    break
                if loop.time() - last_sent >= KEEPALIVE_SECS:
                    yield {"type": "keepalive"}
                    last_sent = loop.time()
        finally:
            self.runs.pop(msg_id, None)
        # A restarted kernel starts from the sandbox's environment anyway.
        if env_vars and self.generation == generation and self.alive():
            await self._silent(ENV_RESTORE_CODE)
        yield {"type": "end_of_execution"}

    async def _abort(self, run):
        """The client left mid-cell: interrupt it; restart the kernel if it does not stop."""
        log.info("%s: client disconnected, interrupting the cell", self.id)
        try:
            await self.km.interrupt_kernel()
        except Exception as e:
            log.warning("%s: interrupt: %s", self.id, e)
        deadline = asyncio.get_running_loop().time() + INTERRUPT_GRACE_SECS
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                msg = await asyncio.wait_for(run.queue.get(), remaining)
            except asyncio.TimeoutError:
                break
            if translate(msg)[1]:
                return
        if run.restarted.is_set() or not self.alive():
            return
        log.warning("%s: the cell ignored the interrupt, restarting the kernel", self.id)
        await self._restart_kernel()


class Contexts:
    def __init__(self):
        self.by_id = {}
        self.default = None  # the default Python context
        self.default_lock = asyncio.Lock()

    async def create(self, language, cwd):
        ctx = Context(language, cwd)
        try:
            await ctx.start()
        except Exception:
            await ctx.shutdown()
            raise
        self.by_id[ctx.id] = ctx
        return ctx

    async def get_default(self):
        async with self.default_lock:
            if self.default is None or self.default.id not in self.by_id:
                self.default = await self.create("python", DEFAULT_CWD)
            return self.default

    async def remove(self, ctx):
        self.by_id.pop(ctx.id, None)
        if self.default is ctx:
            self.default = None
        await ctx.shutdown()


# ---------------------------------------------------------------------------------------------
# HTTP.

def make_app(contexts):
    import tornado.web

    class Handler(tornado.web.RequestHandler):
        def set_default_headers(self):
            self.set_header("Content-Type", "application/json")

        def fail(self, status, message):
            # The SDK shows the body of an error as text.
            self.set_status(status)
            self.set_header("Content-Type", "text/plain; charset=utf-8")
            self.finish(message)

        def body_json(self):
            raw = self.request.body or b""
            if not raw.strip():
                return {}
            try:
                data = json.loads(raw)
            except ValueError as e:
                raise BadRequest(f"invalid JSON body: {e}")
            if not isinstance(data, dict):
                raise BadRequest("the body must be a JSON object")
            return data

        def write_error(self, status_code, **kwargs):
            exc = kwargs.get("exc_info", (None, None))[1]
            self.set_header("Content-Type", "text/plain; charset=utf-8")
            self.finish(str(exc) if exc else self._reason)

    class BadRequest(Exception):
        pass

    class Health(Handler):
        def get(self):
            self.finish(json.dumps("OK"))

    class Execute(Handler):
        def initialize(self):
            self.closed = asyncio.Event()

        def on_connection_close(self):
            self.closed.set()

        async def post(self):
            try:
                body = self.body_json()
            except BadRequest as e:
                return self.fail(400, str(e))
            code = body.get("code")
            if not isinstance(code, str):
                return self.fail(400, "code must be a string")
            context_id = body.get("context_id")
            language = body.get("language")
            if context_id and language:
                return self.fail(400, "context_id and language are mutually exclusive: give one")
            env_vars = body.get("env_vars")
            problem = check_env_vars(env_vars)
            if problem:
                return self.fail(400, problem)
            if context_id:
                ctx = contexts.by_id.get(context_id)
                if ctx is None:
                    return self.fail(404, f"context {context_id} not found")
            else:
                if normalize_language(language) is None:
                    return self.fail(400, f"language {language!r} is not available in this sandbox: it runs python")
                try:
                    ctx = await contexts.get_default()
                except Exception as e:
                    return self.fail(500, f"cannot start the python kernel: {e}")
            self.set_header("Content-Type", "application/x-ndjson")
            async for line in ctx.execute(code, env_vars, self.closed):
                if self.closed.is_set():
                    continue
                self.write(json.dumps(line) + "\n")
                try:
                    await self.flush()
                except Exception:
                    self.closed.set()
            if not self.closed.is_set():
                self.finish()

    class ContextList(Handler):
        def get(self):
            self.finish(json.dumps([c.describe() for c in contexts.by_id.values()]))

        async def post(self):
            try:
                body = self.body_json()
            except BadRequest as e:
                return self.fail(400, str(e))
            language = normalize_language(body.get("language"))
            if language is None:
                return self.fail(400, f"language {body.get('language')!r} is not available in this sandbox: it runs python")
            cwd = body.get("cwd") or DEFAULT_CWD
            if not isinstance(cwd, str) or not os.path.isdir(cwd):
                return self.fail(400, f"cwd {cwd!r} is not a directory in the sandbox")
            try:
                ctx = await contexts.create(language, cwd)
            except Exception as e:
                return self.fail(500, f"cannot start a kernel: {e}")
            self.finish(json.dumps(ctx.describe()))

    class ContextOne(Handler):
        async def delete(self, context_id):
            ctx = contexts.by_id.get(context_id)
            if ctx is None:
                return self.fail(404, f"context {context_id} not found")
            await contexts.remove(ctx)
            self.finish("null")

    class ContextRestart(Handler):
        async def post(self, context_id):
            ctx = contexts.by_id.get(context_id)
            if ctx is None:
                return self.fail(404, f"context {context_id} not found")
            try:
                await ctx.restart()
            except Exception as e:
                return self.fail(500, f"cannot restart the context: {e}")
            self.finish("null")

    return tornado.web.Application(
        [
            (r"/health", Health),
            (r"/execute", Execute),
            (r"/contexts", ContextList),
            (r"/contexts/([^/]+)", ContextOne),
            (r"/contexts/([^/]+)/restart", ContextRestart),
        ]
    )


async def main():
    logging.basicConfig(
        level=os.environ.get("CORDON_INTERP_LOG", "WARNING").upper(),
        format="cordon-interp: %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    contexts = Contexts()
    # The port opens only once the default context answers: readiness is "port is open".
    await contexts.get_default()
    import tornado.httpserver

    server = tornado.httpserver.HTTPServer(make_app(contexts), max_body_size=256 << 20, idle_connection_timeout=3600)
    server.listen(PORT, HOST)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.stop()
    for ctx in list(contexts.by_id.values()):
        await ctx.shutdown()


if __name__ == "__main__":
    # jupyter_client's kernel spec lookup imports ipykernel, whose debugger imports debugpy and
    # its bundled pydevd (~90 modules, and a warning about frozen modules on stderr). Nothing
    # here debugs: with debugpy unimportable the server starts faster (16 s instead of 28 s of
    # imports under the vm tier's TCG), as the kernels already do (KERNEL_LAUNCHER).
    sys.modules["debugpy"] = None
    asyncio.run(main())
