// The official E2B JavaScript SDK (npm `e2b`) against `cordon serve`: sandboxes that keep their
// state. Pause with memory (same processes, same boot), pause to files (a fresh boot on the same
// files), resume by connect or by traffic (lifecycle auto-pause), forks and snapshots.
// tests/e2b/run.sh starts the server and sets E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL;
// run by hand with those exported: `node --test tests/e2b/js/`.
//
// Each test makes its own sandboxes with a short timeout and kills them (and deletes its
// snapshots) in a `finally`, so a failed assertion leaves nothing running. The machine may be
// small and busy: test timeouts are generous, waits are polls bounded only by a deadline, and
// nothing compares a duration against a fixed number.

import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { test } from 'node:test'
import { statSync } from 'node:fs'
import { setTimeout as sleep } from 'node:timers/promises'

import { Sandbox, SandboxNotFoundError } from 'e2b'

for (const name of ['E2B_API_KEY', 'E2B_API_URL', 'E2B_SANDBOX_URL']) {
  if (!process.env[name]) throw new Error(`${name} is not set: run this suite through tests/e2b/run.sh`)
}

// Per test: room for a few sandbox creates, pauses and resumes on a loaded 2-core machine.
const T = { timeout: 240_000 }
// The sandbox's own lifetime: long enough for the test, short enough that a leak ends soon.
const LIFE_MS = 120_000

async function withSandbox(opts, fn) {
  const sbx = await Sandbox.create({ timeoutMs: LIFE_MS, metadata: { suite: 'cordon-js-state' }, ...opts })
  try {
    return await fn(sbx)
  } finally {
    await sbx.kill()
  }
}

// Kills every Sandbox of `list` (skipping the Errors a fork may give), whatever happens to each.
async function killAll(list) {
  await Promise.allSettled(list.filter((s) => s instanceof Sandbox).map((s) => s.kill()))
}

const bootId = async (sbx) => (await sbx.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout
const alive = async (sbx, pid) => (await sbx.commands.run(`kill -0 ${pid} 2>/dev/null && echo alive || echo gone`)).stdout

// Every snapshot id on every page of `Sandbox.listSnapshots()`.
async function listedSnapshots() {
  const pager = Sandbox.listSnapshots()
  const ids = []
  while (pager.hasNext) ids.push(...(await pager.nextItems()).map((s) => s.snapshotId))
  return ids
}

// Polls Sandbox.getInfo(id) until its state is `state`; the deadline only bounds the wait.
async function waitState(id, state, ms = 90_000) {
  const deadline = Date.now() + ms
  let info = await Sandbox.getInfo(id)
  while (info.state !== state && Date.now() < deadline) {
    await sleep(200)
    info = await Sandbox.getInfo(id)
  }
  return info.state
}

test('pause with memory keeps processes; connect() resumes the same sandbox', T, async () => {
  await withSandbox({}, async (sbx) => {
    const id = sbx.sandboxId
    const p = `/home/user/${randomUUID()}`
    await sbx.files.write(p, 'before the pause')
    const h = await sbx.commands.run('sleep 3600', { background: true })
    assert.ok(Number.isInteger(h.pid) && h.pid > 0, `pid ${h.pid}`)
    const boot = await bootId(sbx)

    assert.equal(await sbx.pause(), true)
    assert.equal(await sbx.isRunning(), false, 'a paused sandbox answers /health')
    assert.equal((await Sandbox.getInfo(id)).state, 'paused')
    assert.equal(await sbx.pause(), false, 'a second pause must say it was already paused')
    assert.equal(await Sandbox.pause(id), false)
    assert.equal((await Sandbox.getInfo(id)).state, 'paused')

    const same = await sbx.connect({ timeoutMs: LIFE_MS })
    assert.equal(same, sbx, 'connect() on an instance gives that instance')
    assert.equal(sbx.sandboxId, id)
    assert.equal(await sbx.isRunning(), true)
    assert.equal((await Sandbox.getInfo(id)).state, 'running')
    // The same object runs commands, and sees the same process and the same boot.
    assert.equal(await alive(sbx, h.pid), 'alive\n')
    assert.equal(await bootId(sbx), boot, 'a memory resume must not reboot')
    assert.equal(await sbx.files.read(p), 'before the pause')
    assert.ok((await sbx.commands.list()).some((c) => c.pid === h.pid), 'the background command is not in commands.list()')
    // The handle from before the pause still works.
    assert.equal(await h.kill(), true)
    assert.equal(await alive(sbx, h.pid), 'gone\n')
  })
})

test('filesystem pause keeps files; Sandbox.connect(id) boots it afresh', T, async () => {
  await withSandbox({}, async (sbx) => {
    const id = sbx.sandboxId
    const p = `/home/user/${randomUUID()}`
    await sbx.files.write(p, 'kept on disk')
    const h = await sbx.commands.run('sleep 3600', { background: true })
    const boot = await bootId(sbx)

    assert.equal(await sbx.pause({ keepMemory: false }), true)
    assert.equal((await Sandbox.getInfo(id)).state, 'paused')
    assert.equal(await sbx.isRunning(), false)
    assert.equal(await sbx.pause({ keepMemory: false }), false)

    const again = await Sandbox.connect(id, { timeoutMs: LIFE_MS })
    assert.equal(again.sandboxId, id)
    assert.equal((await Sandbox.getInfo(id)).state, 'running')
    assert.equal(await again.files.read(p), 'kept on disk')
    const fresh = await bootId(again)
    assert.match(fresh, /^[0-9a-f-]{36}\n$/)
    assert.notEqual(fresh, boot, 'a filesystem resume must be a fresh boot')
    assert.equal(await alive(again, h.pid), 'gone\n', 'a process outlived a filesystem pause')
    // The first client's object reaches the resumed sandbox too.
    assert.equal(await sbx.files.read(p), 'kept on disk')
  })
})

test('fork: copies of the files, with their own ids; not of a paused or killed sandbox', T, async () => {
  await withSandbox({}, async (sbx) => {
    const p = '/home/user/state'
    await sbx.files.write(p, 'state before fork')
    const forks = []
    try {
      const one = await sbx.fork({ timeoutMs: LIFE_MS })
      forks.push(...one)
      assert.equal(one.length, 1)
      const [fork] = one
      assert.ok(fork instanceof Sandbox, `not a Sandbox: ${fork?.stack ?? fork}`)
      assert.notEqual(fork.sandboxId, sbx.sandboxId)
      assert.equal(await sbx.isRunning(), true, 'the source must run on after a fork')
      assert.equal(await fork.files.read(p), 'state before fork')
      await fork.files.write(p, 'written in the fork')
      assert.equal(await fork.files.read(p), 'written in the fork')
      assert.equal(await sbx.files.read(p), 'state before fork', 'a write in the fork reached the source')

      const two = await sbx.fork({ count: 2, timeoutMs: LIFE_MS })
      forks.push(...two)
      assert.equal(two.length, 2)
      for (const f of two) assert.ok(f instanceof Sandbox, `not a Sandbox: ${f?.stack ?? f}`)
      const ids = new Set([sbx.sandboxId, fork.sandboxId, ...two.map((f) => f.sandboxId)])
      assert.equal(ids.size, 4, `ids not distinct: ${[...ids]}`)
      await two[0].files.write(p, 'zero')
      assert.equal(await two[1].files.read(p), 'state before fork', 'two forks share a write')
    } finally {
      await killAll(forks)
    }

    assert.equal(await sbx.pause(), true)
    await assert.rejects(sbx.fork({ timeoutMs: LIFE_MS }), (e) => {
      assert.ok(e instanceof Error, `${e}`)
      return true
    })
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused', 'a refused fork changed the state')
    assert.equal(await sbx.kill(), true)
    await assert.rejects(sbx.fork({ timeoutMs: LIFE_MS }), SandboxNotFoundError)
    await assert.rejects(Sandbox.fork(sbx.sandboxId, { timeoutMs: LIFE_MS }), SandboxNotFoundError)
  })
})

test('lifecycle: paused at its timeout, woken by traffic with its processes', T, async () => {
  const sbx = await Sandbox.create({
    timeoutMs: 3_000,
    metadata: { suite: 'cordon-js-state' },
    lifecycle: { onTimeout: 'pause', autoResume: true },
  })
  try {
    const id = sbx.sandboxId
    const h = await sbx.commands.run('sleep 3600', { background: true })
    const info = await Sandbox.getInfo(id)
    assert.deepEqual(info.lifecycle, { onTimeout: 'pause', autoResume: true })
    assert.equal(await waitState(id, 'paused'), 'paused', 'never auto-paused at its timeout')
    // Any request wakes it, /health included (that is what isRunning() asks).
    assert.equal(await sbx.isRunning(), true)
    assert.equal(await alive(sbx, h.pid), 'alive\n')
    // It is running again (it may have paused again since, if its timeout is short once more:
    // then a command is traffic and wakes it as well).
    assert.equal((await sbx.commands.run('echo awake')).stdout, 'awake\n')
  } finally {
    await Sandbox.kill(sbx.sandboxId)
  }
})

test('snapshot: a new sandbox from it, listed, deleted once', T, async () => {
  await withSandbox({}, async (sbx) => {
    const p = '/home/user/snapped'
    const token = randomUUID()
    await sbx.files.write(p, token)
    const snap = await sbx.createSnapshot()
    let deleted = false
    try {
      assert.ok(snap.snapshotId, JSON.stringify(snap))
      // The source goes on, with its files.
      assert.equal(await sbx.isRunning(), true)
      assert.equal(await sbx.files.read(p), token)

      const child = await Sandbox.create(snap.snapshotId, { timeoutMs: LIFE_MS })
      try {
        assert.notEqual(child.sandboxId, sbx.sandboxId)
        assert.equal(await child.files.read(p), token)
        await child.files.write(p, 'changed in the child')
        assert.equal(await sbx.files.read(p), token, 'a write in the child reached the source')
      } finally {
        await child.kill()
      }

      const listed = await listedSnapshots()
      assert.ok(listed.includes(snap.snapshotId), `${snap.snapshotId} not in listSnapshots(): ${listed}`)

      assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
      deleted = true
      assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
      assert.ok(!(await listedSnapshots()).includes(snap.snapshotId), 'a deleted snapshot is still listed')
    } finally {
      if (!deleted) await Sandbox.deleteSnapshot(snap.snapshotId)
    }
  })
})

// The gvisor tier pauses to disk (runsc checkpoint): the create names the tier (a cordon field
// the SDK does not send), then the SDK drives it as any sandbox. Skipped without runsc.
const runsc = ['/usr/bin/runsc', '/usr/local/bin/runsc', '/usr/sbin/runsc'].some((p) => { try { return statSync(p).isFile() } catch { return false } })
test('a gvisor sandbox paused with memory comes back with its processes', { ...T, skip: !runsc && 'runsc is not installed' }, async () => {
  const r = await fetch(`${process.env.E2B_API_URL}/sandboxes`, {
    method: 'POST',
    headers: { 'X-API-KEY': process.env.E2B_API_KEY, 'Content-Type': 'application/json' },
    body: JSON.stringify({ templateID: 'base', tier: 'gvisor', timeout: LIFE_MS / 1000 }),
  })
  assert.equal(r.status, 201, await r.clone().text())
  const id = (await r.json()).sandboxID
  const sbx = await Sandbox.connect(id)
  try {
    const h = await sbx.commands.run('sleep 3600', { background: true })
    await sbx.files.write('/tmp/kept', 'in /tmp')
    assert.equal(await sbx.pause(), true)
    assert.equal(await sbx.isRunning(), false)
    assert.equal((await Sandbox.getInfo(id)).state, 'paused')
    await sbx.connect({ timeoutMs: LIFE_MS })
    assert.equal(await alive(sbx, h.pid), 'alive\n', 'a process did not survive the pause to disk')
    assert.equal(await sbx.files.read('/tmp/kept'), 'in /tmp')
  } finally {
    await sbx.kill()
  }
})
