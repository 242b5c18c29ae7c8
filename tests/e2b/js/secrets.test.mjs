// The official E2B JavaScript SDK (npm `e2b`) against `cordon serve`: secrets. `Secret.create`
// answers the secret without its value, a taken name (in any case) is a 409, an invalid or
// reserved name a 400; `getInfo`/`exists` find it by ID or by name in any case; `update` bumps
// the version and keeps or replaces the metadata; `list` pages with `limit` and `nextToken`;
// `destroy` is true once, then false.
// tests/e2b/run.sh starts the server and sets E2B_API_KEY and E2B_API_URL; run by hand with those
// exported: `node --test tests/e2b/js/`. Each test makes secrets of unique names and destroys
// them in a `finally`. (The store's files and the server's log are checked by test_secrets.py,
// which runs its own server.)

import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { test } from 'node:test'

import { Secret, SecretError, SecretNotFoundError } from 'e2b'

for (const name of ['E2B_API_KEY', 'E2B_API_URL']) {
  if (!process.env[name]) throw new Error(`${name} is not set: run this suite through tests/e2b/run.sh`)
}

const uniqueName = () => `js-${randomUUID().slice(0, 13)}`
const uniqueValue = () => `v-${randomUUID()}-${randomUUID()}`

test('create, get, update, destroy a secret; its value never comes back', async () => {
  const name = uniqueName()
  const [v1, v2] = [uniqueValue(), uniqueValue()]
  const made = await Secret.create(name.toUpperCase(), v1, { metadata: { team: 'ml' } })
  try {
    assert.match(made.secretId, /^sec_/)
    assert.equal(made.name, name)
    assert.equal(made.version, 1)
    assert.deepEqual(made.metadata, { team: 'ml' })
    assert.ok(made.createdAt instanceof Date && !Number.isNaN(made.createdAt.getTime()))
    assert.ok(!JSON.stringify(made).includes(v1))

    for (const key of [made.secretId, name, name.toUpperCase()]) {
      const info = await Secret.getInfo(key)
      assert.equal(info.secretId, made.secretId, key)
      assert.ok(!JSON.stringify(info).includes(v1))
    }
    assert.equal(await Secret.exists(name.toUpperCase()), true)
    assert.equal(await Secret.exists(uniqueName()), false)
    await assert.rejects(Secret.getInfo(uniqueName()), SecretNotFoundError)

    const kept = await Secret.update(name, v2)
    assert.equal(kept.version, 2)
    assert.deepEqual(kept.metadata, { team: 'ml' })
    const replaced = await Secret.update(made.secretId, v1, { metadata: { owner: 'me' } })
    assert.equal(replaced.version, 3)
    assert.deepEqual(replaced.metadata, { owner: 'me' })
    await assert.rejects(Secret.update(uniqueName(), v1), SecretNotFoundError)

    // A taken name, in any case, is a conflict (not a missing secret).
    await assert.rejects(Secret.create(name, uniqueValue()), (e) => e instanceof SecretError && !(e instanceof SecretNotFoundError) && /^409/.test(e.message))
  } finally {
    assert.equal(await Secret.destroy(name.toUpperCase()), true)
  }
  assert.equal(await Secret.destroy(made.secretId), false)
  assert.equal(await Secret.exists(made.secretId), false)
})

test('invalid and reserved names are 400s that do not quote the value', async () => {
  for (const bad of ['has space', 'sec_reserved', 'SEC_x', 'x'.repeat(129), 'dot.ted']) {
    const value = uniqueValue()
    await assert.rejects(Secret.create(bad, value), (e) => e instanceof SecretError && /^400/.test(e.message) && !e.message.includes(value), bad)
  }
})

test('list pages with limit and nextToken, oldest first', async () => {
  const made = []
  try {
    for (let i = 0; i < 3; i++) made.push(await Secret.create(uniqueName(), uniqueValue()))
    const ids = new Set(made.map((s) => s.secretId))
    const seen = []
    const pages = Secret.list({ limit: 1 })
    while (pages.hasNext) {
      const items = await pages.nextItems()
      assert.ok(items.length <= 1)
      seen.push(...items.map((s) => s.secretId))
    }
    assert.deepEqual(seen.filter((id) => ids.has(id)), made.map((s) => s.secretId))
    const first = Secret.list({ limit: 1 })
    await first.nextItems()
    assert.ok(first.nextToken)
    const rest = await Secret.list({ limit: 100, nextToken: first.nextToken }).nextItems()
    assert.deepEqual(rest.map((s) => s.secretId), seen.slice(1))
  } finally {
    for (const s of made) await Secret.destroy(s.secretId)
  }
})
