// The official E2B JavaScript SDK (npm `e2b`) against `cordon serve`: persistent volumes. A volume
// is made and filled through the content API (`Volume`, with its own bearer token), mounted into
// sandboxes of two tiers at once (namespaces, and gVisor), shared between them both ways, kept
// after they end, refused deletion while in use, and deleted once.
// tests/e2b/run.sh starts the server and sets E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL and
// E2B_VOLUME_API_URL (the content API, served by the same server); run by hand with those
// exported: `node --test tests/e2b/js/`.
//
// Each test makes its own volume (a unique name) and sandboxes with a short timeout, and kills the
// sandboxes and then deletes the volume in a `finally`, so a failed assertion leaves nothing
// behind. The machine may be small and busy: test timeouts are generous and nothing compares a
// duration against a fixed number.
//
// Owners are read inside the sandboxes with Python's os.stat, not `ls -l` or `stat`: an old runsc
// rejects statx's AT_NO_AUTOMOUNT with EINVAL, so those tools fail in the gvisor tier.

import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { test } from 'node:test'
import { accessSync, constants, statSync } from 'node:fs'
import { release } from 'node:os'
import { join } from 'node:path'

import { Sandbox, Volume, VolumeError, VolumeNotFoundError } from 'e2b'

for (const name of ['E2B_API_KEY', 'E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_VOLUME_API_URL']) {
  if (!process.env[name]) throw new Error(`${name} is not set: run this suite through tests/e2b/run.sh`)
}

// Per test: room for three sandbox creates (one of them gVisor) on a loaded 2-core machine.
const T = { timeout: 300_000 }
// The sandbox's own lifetime: long enough for the test, short enough that a leak ends soon.
const LIFE_MS = 120_000
const META = { suite: 'cordon-js-volumes' }
const MNT = '/mnt/data'

// The gvisor tier needs runsc: on PATH, or named by CORDON_RUNSC (as the server looks for it).
const onPath = (bin) =>
  (process.env.PATH ?? '').split(':').filter(Boolean).some((dir) => {
    try {
      const p = join(dir, bin)
      accessSync(p, constants.X_OK)
      return statSync(p).isFile()
    } catch {
      return false
    }
  })
const noGvisor = !process.env.CORDON_RUNSC && !onPath('runsc') && 'runsc is not on PATH and CORDON_RUNSC is unset'

// A gvisor sandbox: the SDK cannot send the `tier` field, so the create is a plain POST (with the
// mounts in the API's own form), then the SDK connects to it.
async function createGvisor(volumeMounts) {
  const r = await fetch(`${process.env.E2B_API_URL}/sandboxes`, {
    method: 'POST',
    headers: { 'X-API-KEY': process.env.E2B_API_KEY, 'Content-Type': 'application/json' },
    body: JSON.stringify({ templateID: 'base', tier: 'gvisor', timeout: LIFE_MS / 1000, metadata: META, volumeMounts }),
  })
  assert.equal(r.status, 201, await r.clone().text())
  return await Sandbox.connect((await r.json()).sandboxID)
}

// [uid, gid, permission bits] of each path, as the sandbox's default user sees them.
async function owners(sbx, paths) {
  const py = 'import json,os,stat,sys; print(json.dumps([[s.st_uid, s.st_gid, stat.S_IMODE(s.st_mode)] for s in map(os.stat, sys.argv[1:])]))'
  const r = await sbx.commands.run(`python3 -c '${py}' ${paths.join(' ')}`)
  return JSON.parse(r.stdout)
}

const cat = async (sbx, path) => (await sbx.commands.run(`cat ${path}`)).stdout

// The files the content API wrote before any mount, seen from inside a sandbox mounting the
// volume at `mnt`: contents, owners and modes as the API set them.
async function seesApiFiles(sbx, mnt, label) {
  assert.deepEqual(
    await owners(sbx, [mnt, `${mnt}/shared`, `${mnt}/shared/notes.txt`, `${mnt}/root.txt`]),
    [[1000, 1000, 0o755], [1000, 1000, 0o755], [1000, 1000, 0o640], [0, 0, 0o644]],
    `owners of the volume's files in the ${label} sandbox`,
  )
  assert.equal(await cat(sbx, `${mnt}/shared/notes.txt`), 'notes from the api', label)
  assert.equal(await sbx.files.read(`${mnt}/root.txt`), 'owned by root', label)
  const names = (await sbx.files.list(`${mnt}/shared`)).map((e) => e.name)
  assert.ok(names.includes('notes.txt'), `${label}: ${names}`)
}

test('a volume filled through the content API, shared by an ns and a gvisor sandbox, kept after them, deleted once', T, async (t) => {
  const name = `cordon-js-${randomUUID()}`
  const vol = await Volume.create(name)
  const sandboxes = []
  let destroyed = false
  try {
    assert.equal(vol.name, name)
    assert.ok(vol.volumeId && vol.token, JSON.stringify(vol))
    const info = await Volume.getInfo(vol.volumeId)
    assert.equal(info.volumeId, vol.volumeId)
    assert.equal(info.name, name)
    assert.ok((await Volume.list()).some((v) => v.volumeId === vol.volumeId && v.name === name), 'the new volume is not listed')

    // A new volume's root belongs to the images' default user (uid 1000), who can write there.
    const top = await vol.getInfo('/')
    assert.deepEqual([top.type, top.uid, top.gid, top.mode], ['directory', 1000, 1000, 0o755])
    // The content API: a directory for uid 1000, a private file of theirs, a file of root's.
    const dir = await vol.makeDir('/shared', { uid: 1000, gid: 1000 })
    assert.deepEqual([dir.type, dir.name, dir.path, dir.uid, dir.gid, dir.mode], ['directory', 'shared', '/shared', 1000, 1000, 0o755])
    const notes = await vol.writeFile('/shared/notes.txt', 'notes from the api', { uid: 1000, gid: 1000, mode: 0o640 })
    assert.deepEqual([notes.type, notes.size, notes.uid, notes.gid, notes.mode], ['file', 18, 1000, 1000, 0o640])
    const root = await vol.writeFile('/root.txt', 'owned by root')
    assert.deepEqual([root.type, root.uid, root.gid, root.mode], ['file', 0, 0, 0o644])
    assert.equal(await vol.readFile('/shared/notes.txt'), 'notes from the api')
    assert.equal(await vol.exists('/shared/notes.txt'), true)
    assert.equal(await vol.exists('/shared/nothing'), false)
    assert.deepEqual((await vol.list('/')).map((e) => e.name).sort(), ['root.txt', 'shared'])

    // Two sandboxes of different tiers mount it at once: an ns one by the SDK with the Volume,
    // a gvisor one by a raw create with the volume's name.
    const ns = await Sandbox.create({ timeoutMs: LIFE_MS, metadata: META, volumeMounts: { [MNT]: vol } })
    sandboxes.push(ns)
    let other
    if (noGvisor) {
      t.skip(`${noGvisor}: the second sandbox is an ns one, not gvisor`)
      other = await Sandbox.create({ timeoutMs: LIFE_MS, metadata: META, volumeMounts: { [MNT]: name } })
    } else {
      other = await createGvisor([{ name, path: MNT }])
      // gVisor's own kernel answers, not the host's.
      assert.notEqual((await other.commands.run('uname -r')).stdout.trim(), release())
    }
    sandboxes.push(other)
    const otherLabel = noGvisor ? 'second ns' : 'gvisor'

    for (const sbx of [ns, other]) {
      assert.deepEqual((await Sandbox.getInfo(sbx.sandboxId)).volumeMounts, [{ name, path: MNT }])
      assert.deepEqual((await sbx.getInfo()).volumeMounts, [{ name, path: MNT }])
      assert.equal((await sbx.commands.run('id -u')).stdout, '1000\n')
    }
    await seesApiFiles(ns, MNT, 'ns')
    await seesApiFiles(other, MNT, otherLabel)

    // Written in one, read in the other, both ways; by the SDK's files and by a shell.
    await ns.files.write(`${MNT}/shared/from-ns.txt`, 'written in the ns sandbox')
    assert.equal(await cat(other, `${MNT}/shared/from-ns.txt`), 'written in the ns sandbox')
    await other.commands.run(`echo -n 'written in the ${otherLabel} sandbox' > ${MNT}/shared/from-other.txt`)
    assert.equal(await ns.files.read(`${MNT}/shared/from-other.txt`), `written in the ${otherLabel} sandbox`)
    await other.files.write(`${MNT}/shared/notes.txt`, 'notes changed in the other sandbox')
    assert.equal(await cat(ns, `${MNT}/shared/notes.txt`), 'notes changed in the other sandbox')
    // A write through the content API while both are mounted reaches both.
    await vol.writeFile('/shared/live.txt', 'written while mounted', { uid: 1000, gid: 1000 })
    assert.equal(await cat(ns, `${MNT}/shared/live.txt`), 'written while mounted')
    assert.equal(await cat(other, `${MNT}/shared/live.txt`), 'written while mounted')
    const perOwner = [[1000, 1000, 0o644], [1000, 1000, 0o644], [1000, 1000, 0o640]]
    const written = [`${MNT}/shared/from-ns.txt`, `${MNT}/shared/from-other.txt`, `${MNT}/shared/notes.txt`]
    assert.deepEqual(await owners(ns, written), perOwner, 'owners of the files written in the sandboxes, from ns')
    assert.deepEqual(await owners(other, written), perOwner, `owners of the files written in the sandboxes, from ${otherLabel}`)

    // A volume in use is not deleted, and stays whole.
    await assert.rejects(Volume.destroy(vol.volumeId), (e) => {
      assert.ok(e instanceof VolumeError, `${e}`)
      assert.match(e.message, /^409\b/)
      return true
    })
    assert.equal((await Volume.getInfo(vol.volumeId)).name, name)
    assert.equal(await vol.readFile('/shared/from-ns.txt'), 'written in the ns sandbox')
    assert.equal(await cat(ns, `${MNT}/root.txt`), 'owned by root')
    assert.equal(await other.files.read(`${MNT}/shared/from-ns.txt`), 'written in the ns sandbox')

    assert.equal(await ns.kill(), true)
    assert.equal(await other.kill(), true)

    // A third sandbox, mounting it by name at another path, finds everything.
    const third = await Sandbox.create({ timeoutMs: LIFE_MS, metadata: META, volumeMounts: { '/data': name } })
    sandboxes.push(third)
    assert.deepEqual((await third.getInfo()).volumeMounts, [{ name, path: '/data' }])
    assert.deepEqual(await owners(third, ['/data/shared', '/data/root.txt']), [[1000, 1000, 0o755], [0, 0, 0o644]])
    assert.equal(await third.files.read('/data/root.txt'), 'owned by root')
    assert.equal(await cat(third, '/data/shared/notes.txt'), 'notes changed in the other sandbox')
    assert.equal(await cat(third, '/data/shared/from-ns.txt'), 'written in the ns sandbox')
    assert.equal(await cat(third, '/data/shared/from-other.txt'), `written in the ${otherLabel} sandbox`)
    assert.equal(await cat(third, '/data/shared/live.txt'), 'written while mounted')
    assert.deepEqual(await owners(third, ['/data/shared/from-ns.txt', '/data/shared/from-other.txt', '/data/shared/notes.txt']), perOwner)
    assert.equal(await third.kill(), true)

    // And so does the content API, through a fresh connection by id.
    const again = await Volume.connect(vol.volumeId)
    assert.equal(again.name, name)
    assert.deepEqual((await again.list('/shared')).map((e) => e.name).sort(), ['from-ns.txt', 'from-other.txt', 'live.txt', 'notes.txt'])
    assert.equal(await again.readFile('/shared/from-ns.txt'), 'written in the ns sandbox')
    assert.equal(await again.readFile('/shared/from-other.txt'), `written in the ${otherLabel} sandbox`)
    assert.equal(await again.readFile('/shared/notes.txt'), 'notes changed in the other sandbox')
    assert.equal(await again.readFile('/root.txt'), 'owned by root')
    for (const p of ['/shared/from-ns.txt', '/shared/from-other.txt']) {
      const st = await again.getInfo(p)
      assert.deepEqual([st.type, st.uid, st.gid, st.mode], ['file', 1000, 1000, 0o644], `${p} written inside a sandbox`)
    }
    const changed = await again.updateMetadata('/root.txt', { uid: 1000, mode: 0o600 })
    assert.deepEqual([changed.uid, changed.gid, changed.mode], [1000, 0, 0o600])
    await again.remove('/shared/live.txt')
    assert.equal(await again.exists('/shared/live.txt'), false)

    // Deleted once; then it is gone.
    assert.equal(await Volume.destroy(vol.volumeId), true)
    destroyed = true
    await assert.rejects(Volume.getInfo(vol.volumeId), VolumeNotFoundError)
    assert.equal(await Volume.destroy(vol.volumeId), false)
    assert.ok(!(await Volume.list()).some((v) => v.volumeId === vol.volumeId), 'a deleted volume is still listed')
    await assert.rejects(again.readFile('/root.txt'), VolumeError)
  } finally {
    await Promise.allSettled(sandboxes.map((s) => Sandbox.kill(s.sandboxId)))
    if (!destroyed) await Volume.destroy(vol.volumeId)
  }
})
