// The official E2B JavaScript SDK (npm `e2b`) against `cordon serve`: what a JS user does first.
// tests/e2b/run.sh starts the server and sets E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL;
// run by hand with those exported: `node --test tests/e2b/js/`.
//
// Each test makes its own sandbox with a short timeout and kills it in a `finally`, so a failed
// assertion leaves nothing running. The machine may be small and busy: test timeouts are
// generous and nothing compares a duration against a fixed number.

import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import fs from 'node:fs'
import http from 'node:http'
import os from 'node:os'
import path from 'node:path'
import { test } from 'node:test'
import { setTimeout as sleep } from 'node:timers/promises'

import { AuthenticationError, BuildError, CommandExitError, FileNotFoundError, Sandbox, SandboxNotFoundError, Template, waitForPort } from 'e2b'

for (const name of ['E2B_API_KEY', 'E2B_API_URL', 'E2B_SANDBOX_URL']) {
  if (!process.env[name]) throw new Error(`${name} is not set: run this suite through tests/e2b/run.sh`)
}
const SANDBOX_URL = new URL(process.env.E2B_SANDBOX_URL)

// Per test: room for a sandbox create on a loaded 2-core machine plus the test's own calls.
const T = { timeout: 120_000 }
// The sandbox's own lifetime: long enough for the test, short enough that a leak ends soon.
const LIFE_MS = 120_000

async function withSandbox(opts, fn) {
  const sbx = await Sandbox.create({ timeoutMs: LIFE_MS, metadata: { suite: 'cordon-js' }, ...opts })
  try {
    return await fn(sbx)
  } finally {
    await sbx.kill()
  }
}

// Every sandbox id on every page of `Sandbox.list(opts)`.
async function listedIds(opts) {
  const pager = Sandbox.list(opts)
  const ids = []
  while (pager.hasNext) ids.push(...(await pager.nextItems()).map((s) => s.sandboxId))
  return ids
}

// A plain HTTP/1.1 GET to cordon's one port with the given headers. fetch() cannot be used for
// the Host form: undici replaces a Host header with the URL's own.
function get(path, headers) {
  return new Promise((resolve, reject) => {
    const req = http.get(
      { host: SANDBOX_URL.hostname, port: SANDBOX_URL.port, path, headers, agent: false },
      (res) => {
        let body = ''
        res.setEncoding('utf8')
        res.on('data', (c) => (body += c))
        res.on('end', () => resolve({ status: res.statusCode, body }))
      },
    )
    req.on('error', reject)
  })
}

test('create, then run a command', T, async () => {
  await withSandbox({}, async (sbx) => {
    assert.match(sbx.sandboxId, /^i[a-z0-9]{20}$/)
    const r = await sbx.commands.run('echo hi; echo there >&2')
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'hi\n')
    assert.equal(r.stderr, 'there\n')
    assert.equal((await sbx.commands.run('whoami')).stdout, 'user\n')
    assert.equal((await sbx.commands.run('pwd')).stdout, '/home/user\n')
    assert.equal((await sbx.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n')
    assert.equal((await sbx.commands.run('whoami', { user: 'root' })).stdout, 'root\n')
  })
})

test('a failing command throws CommandExitError', T, async () => {
  await withSandbox({}, async (sbx) => {
    await assert.rejects(sbx.commands.run('echo before; echo why >&2; exit 3'), (e) => {
      assert.ok(e instanceof CommandExitError, `not a CommandExitError: ${e?.stack ?? e}`)
      assert.equal(e.exitCode, 3)
      assert.equal(e.stdout, 'before\n')
      assert.equal(e.stderr, 'why\n')
      return true
    })
    // The sandbox is still usable afterwards.
    assert.equal((await sbx.commands.run('echo after')).stdout, 'after\n')
  })
})

test('onStdout and onStderr receive output while the command runs', T, async () => {
  await withSandbox({}, async (sbx) => {
    const go = `/tmp/go-${randomUUID()}`
    const out = []
    const err = []
    let released = null
    // The command waits for a file that only the onStdout callback creates, on seeing "ready":
    // if output were held back until the command ends, it would never end.
    const r = await sbx.commands.run(`echo ready; echo warn >&2; while [ ! -e ${go} ]; do sleep 0.1; done; echo done`, {
      timeoutMs: 90_000,
      onStdout: (s) => {
        out.push(s)
        if (!released && out.join('').includes('ready\n')) released = sbx.files.write(go, '')
      },
      onStderr: (s) => err.push(s),
    })
    assert.ok(released, 'onStdout never saw "ready"')
    await released
    assert.equal(r.exitCode, 0)
    assert.equal(out.join(''), 'ready\ndone\n')
    assert.equal(err.join(''), 'warn\n')
    assert.equal(r.stdout, 'ready\ndone\n')
    assert.ok(out.length >= 2, `one chunk only: ${JSON.stringify(out)}`)
  })
})

test('a background command, listed, then killed through its handle', T, async () => {
  await withSandbox({}, async (sbx) => {
    const h = await sbx.commands.run('sleep 600', { background: true })
    assert.ok(Number.isInteger(h.pid) && h.pid > 0, `pid ${h.pid}`)
    assert.equal(h.exitCode, undefined)
    assert.ok((await sbx.commands.list()).some((p) => p.pid === h.pid), 'not in commands.list()')
    assert.equal(await h.kill(), true)
    await assert.rejects(h.wait(), CommandExitError)
    const gone = await sbx.commands.run(`kill -0 ${h.pid} 2>/dev/null && echo alive || echo gone`)
    assert.equal(gone.stdout, 'gone\n')
    assert.ok(!(await sbx.commands.list()).some((p) => p.pid === h.pid), 'still in commands.list()')
    assert.equal(await sbx.commands.kill(h.pid), false)

    // One that ends by itself: wait() gives its output.
    const late = await sbx.commands.run('sleep 1; echo late', { background: true })
    const r = await late.wait()
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'late\n')
  })
})

test('files: write and read text and bytes, list, exists, makeDir, remove', T, async () => {
  await withSandbox({}, async (sbx) => {
    const d = `/tmp/${randomUUID()}`
    const info = await sbx.files.write(`${d}/a.txt`, 'héllo')
    assert.equal(info.path, `${d}/a.txt`)
    assert.equal(info.name, 'a.txt')
    assert.equal(await sbx.files.read(`${d}/a.txt`), 'héllo')
    assert.deepEqual(await sbx.files.read(`${d}/a.txt`, { format: 'bytes' }), new TextEncoder().encode('héllo'))
    // The file is there for commands too.
    assert.equal((await sbx.commands.run(`cat ${d}/a.txt`)).stdout, 'héllo')

    const raw = new Uint8Array(25600).map((_, i) => i % 256)
    await sbx.files.write(`${d}/sub/b.bin`, raw.buffer)
    const back = await sbx.files.read(`${d}/sub/b.bin`, { format: 'bytes' })
    assert.ok(back instanceof Uint8Array)
    assert.deepEqual(back, raw)
    // A relative path is under the home directory.
    await sbx.files.write('rel.txt', 'home')
    assert.equal(await sbx.files.read('/home/user/rel.txt'), 'home')

    const entries = await sbx.files.list(d)
    assert.deepEqual(entries.map((e) => e.name).sort(), ['a.txt', 'sub'])
    const a = entries.find((e) => e.name === 'a.txt')
    assert.equal(a.type, 'file')
    assert.equal(a.size, new TextEncoder().encode('héllo').length)
    assert.equal(entries.find((e) => e.name === 'sub').type, 'dir')

    assert.equal(typeof sbx.files.exists, 'function', 'this SDK version has files.exists')
    assert.equal(await sbx.files.exists(`${d}/a.txt`), true)
    assert.equal(await sbx.files.exists(`${d}/zzz`), false)

    assert.equal(await sbx.files.makeDir(`${d}/x/y`), true)
    assert.equal(await sbx.files.makeDir(`${d}/x/y`), false)
    assert.equal(await sbx.files.exists(`${d}/x/y`), true)
    assert.equal((await sbx.files.getInfo(`${d}/x/y`)).type, 'dir')

    await sbx.files.remove(`${d}/a.txt`)
    assert.equal(await sbx.files.exists(`${d}/a.txt`), false)
    await assert.rejects(sbx.files.read(`${d}/a.txt`), FileNotFoundError)
    await sbx.files.remove(`${d}/x`)
    assert.equal(await sbx.files.exists(`${d}/x/y`), false)
    assert.deepEqual((await sbx.files.list(d)).map((e) => e.name), ['sub'])
  })
})

test('envs given at create are seen by commands', T, async () => {
  await withSandbox({ envs: { SBX_LEVEL: 'from-create', OTHER: 'two' } }, async (sbx) => {
    assert.equal((await sbx.commands.run('echo $SBX_LEVEL-$OTHER')).stdout, 'from-create-two\n')
    // A command's own envs win over the sandbox's.
    assert.equal((await sbx.commands.run('echo $SBX_LEVEL', { envs: { SBX_LEVEL: 'cmd' } })).stdout, 'cmd\n')
    assert.equal((await sbx.commands.run('echo $SBX_LEVEL')).stdout, 'from-create\n')
  })
})

test('Sandbox.list() has the sandbox', T, async () => {
  const unique = randomUUID()
  await withSandbox({ metadata: { js_list: unique } }, async (sbx) => {
    assert.ok((await listedIds()).includes(sbx.sandboxId), 'not in Sandbox.list()')
    const found = await Sandbox.list({ query: { metadata: { js_list: unique } } }).nextItems()
    assert.deepEqual(
      found.map((s) => s.sandboxId),
      [sbx.sandboxId],
    )
    assert.equal(found[0].metadata.js_list, unique)
    assert.equal(found[0].state, 'running')
    assert.equal(found[0].templateId, 'base')
  })
})

test('Sandbox.connect(id) from a second client', T, async () => {
  await withSandbox({}, async (sbx) => {
    const p = `/tmp/${randomUUID()}`
    await sbx.files.write(p, 'kept')
    const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: LIFE_MS })
    assert.notEqual(again, sbx)
    assert.equal(again.sandboxId, sbx.sandboxId)
    assert.equal(await again.files.read(p), 'kept')
    const r = await again.commands.run(`cat ${p}; echo; echo ok`)
    assert.equal(r.stdout, 'kept\nok\n')
    // And the other way round.
    await again.files.write(p, 'changed')
    assert.equal(await sbx.files.read(p), 'changed')
  })
})

test('Sandbox.connect of an unknown id fails', T, async () => {
  await assert.rejects(Sandbox.connect('i00000000000000000000'), SandboxNotFoundError)
})

test('a wrong API key is refused', T, async () => {
  await assert.rejects(
    Sandbox.create({ apiKey: 'e2b_1111111111111111111111111111111111111111', timeoutMs: LIFE_MS }),
    AuthenticationError,
  )
})

test('setTimeout moves the end, and the sandbox ends then', T, async () => {
  const sbx = await Sandbox.create({ timeoutMs: LIFE_MS })
  try {
    const first = (await sbx.getInfo()).endAt.getTime()
    await sbx.setTimeout(600_000)
    const longer = (await sbx.getInfo()).endAt.getTime()
    // Now + 600 s against create + 120 s: at least 480 s later however slow the calls were.
    assert.ok(longer - first >= 470_000, `endAt moved by ${longer - first} ms`)
    const before = Date.now()
    await sbx.setTimeout(3_000)
    const shorter = (await sbx.getInfo()).endAt.getTime()
    assert.ok(shorter < longer)
    assert.ok(shorter >= before + 3_000 - 1_000 && shorter <= Date.now() + 3_000 + 1_000, `endAt ${shorter - Date.now()} ms ahead`)
    // It ends by itself (the deadline here is only a bound on waiting).
    const deadline = Date.now() + 90_000
    while ((await sbx.isRunning()) && Date.now() < deadline) await sleep(500)
    assert.equal(await sbx.isRunning(), false)
    await assert.rejects(sbx.commands.run('true'))
    assert.ok(!(await listedIds()).includes(sbx.sandboxId), 'an expired sandbox is still listed')
  } finally {
    await Sandbox.kill(sbx.sandboxId)
  }
})

test('kill: gone from Sandbox.list(), and commands on it fail', T, async () => {
  const sbx = await Sandbox.create({ timeoutMs: LIFE_MS })
  try {
    assert.ok((await listedIds()).includes(sbx.sandboxId))
    assert.equal(await sbx.kill(), true)
    assert.ok(!(await listedIds()).includes(sbx.sandboxId), 'a killed sandbox is still listed')
    // The SDK finds the sandbox gone (envd's 502) and says so.
    await assert.rejects(sbx.commands.run('echo hi'), SandboxNotFoundError)
    await assert.rejects(sbx.files.read('/etc/hostname'), (e) => !(e instanceof FileNotFoundError))
    await assert.rejects(Sandbox.connect(sbx.sandboxId), SandboxNotFoundError)
    // A second kill finds nothing.
    assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  } finally {
    await Sandbox.kill(sbx.sandboxId)
  }
})

test('isRunning is true, then false after kill', T, async () => {
  const sbx = await Sandbox.create({ timeoutMs: LIFE_MS })
  try {
    assert.equal(await sbx.isRunning(), true)
    await sbx.kill()
    assert.equal(await sbx.isRunning(), false)
  } finally {
    await Sandbox.kill(sbx.sandboxId)
  }
})

test('getHost(port) reaches a server started inside', T, async () => {
  await withSandbox({}, async (sbx) => {
    const body = `from inside ${randomUUID()}`
    await sbx.files.write('/home/user/www/hello.txt', body)
    await sbx.commands.run('cd /home/user/www && python3 -m http.server 8000', { background: true })
    const host = sbx.getHost(8000)
    assert.ok(host.startsWith(`8000-${sbx.sandboxId}.`), host)
    // The SDK gives `8000-<id>.<domain>` with no scheme; without wildcard DNS for the domain it is
    // sent to the one port as the Host header (as the Python suite does), which is how cordon
    // routes it.
    let r
    const deadline = Date.now() + 60_000
    do {
      r = await get('/hello.txt', { Host: host })
      if (r.status === 200) break
      await sleep(200)
    } while (Date.now() < deadline)
    assert.equal(r.status, 200, r.body)
    assert.equal(r.body, body)
    // The header form, through fetch.
    const res = await fetch(new URL('/hello.txt', SANDBOX_URL), {
      headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8000' },
    })
    assert.equal(res.status, 200)
    assert.equal(await res.text(), body)
    // A port nothing listens on is cordon's 502, not the server's page.
    const closed = await get('/hello.txt', { Host: sbx.getHost(8001) })
    assert.equal(closed.status, 502, closed.body)
  })
})

// A template built with the JS builder, the same main flow as the Python suite's: files copied,
// steps run, a workdir, a start command whose port is ready before the create returns.
test('Template.build makes a template that Sandbox.create starts', { timeout: 600_000 }, async () => {
  const ctx = fs.mkdtempSync(path.join(os.tmpdir(), 'cordon-js-tpl-'))
  const name = `tpl-js-${randomUUID().slice(0, 8)}`
  try {
    fs.mkdirSync(path.join(ctx, 'app'))
    fs.writeFileSync(path.join(ctx, 'app', 'hello.txt'), 'hello from js\n')
    const token = randomUUID()
    const tpl = Template({ fileContextPath: ctx })
      .fromTemplate('base')
      .copy('app', '/home/user/app')
      .runCmd(`echo ${token} > /home/user/app/token`)
      .setWorkdir('/home/user/app')
      .setStartCmd('python3 -m http.server 8000', waitForPort(8000))
    const info = await Template.build(tpl, name)
    assert.ok(info.templateId && info.buildId, JSON.stringify(info))
    assert.equal(await Template.exists(name), true)
    assert.equal(await Template.exists(`${name}-absent`), false)
    const sbx = await Sandbox.create(name, { timeoutMs: LIFE_MS })
    try {
      const r = await sbx.commands.run("pwd; cat token hello.txt; curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/hello.txt")
      assert.equal(r.stdout, `/home/user/app\n${token}\nhello from js\n200`)
    } finally {
      await sbx.kill()
    }
    // A failing step is a BuildError that says what failed.
    const bad = Template({ fileContextPath: ctx }).fromTemplate('base').runCmd('exit 9')
    await assert.rejects(Template.build(bad, `${name}-bad`), (e) => e instanceof BuildError && /exit 9/.test(e.message))
  } finally {
    fs.rmSync(ctx, { recursive: true, force: true })
    for (const n of [name, `${name}-bad`]) {
      await fetch(new URL(`/templates/${n}`, process.env.E2B_API_URL), { method: 'DELETE', headers: { 'X-API-KEY': process.env.E2B_API_KEY } })
    }
  }
})
