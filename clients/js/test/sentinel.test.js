// redis+sentinel:// URLs: parsing without a server, then a real primary, its replica and one Sentinel on loopback:
// the client finds the primary through Sentinel, and after the primary is SIGKILLed and Sentinel promotes the
// replica, it follows the new primary (producer/sentinel.py's twin; the Python side's failover tests are
// tests/faults/test_fault_failover.py).
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { createClient } from 'redis';
import { Client, RedisUnavailable, isSentinelUrl, parseSentinelUrl } from '../src/index.js';
import { randomQueue, startRedis, startSentinel, waitFor } from './helpers.js';

describe('Sentinel URLs', () => {
  test('parse', () => {
    assert.ok(isSentinelUrl('redis+sentinel://h/pq') && isSentinelUrl('rediss+sentinel://h/pq'));
    assert.ok(!isSentinelUrl('redis://h:6379/0'));
    assert.deepEqual(parseSentinelUrl('redis+sentinel://h1:26380,h2/pq'), {
      name: 'pq',
      sentinelRootNodes: [{ host: 'h1', port: 26380 }, { host: 'h2', port: 26379 }],
      nodeClientOptions: { database: 0 },
      sentinelClientOptions: {},
    });
    assert.deepEqual(parseSentinelUrl('rediss+sentinel://app:s%40cret@[::1]:5000,10.0.0.2/jobs/3?sentinel_password=sp'), {
      name: 'jobs',
      sentinelRootNodes: [{ host: '::1', port: 5000 }, { host: '10.0.0.2', port: 26379 }],
      nodeClientOptions: { database: 3, username: 'app', password: 's@cret', socket: { tls: true } },
      sentinelClientOptions: { password: 'sp', socket: { tls: true } },
    });
  });

  for (const [url, needle] of [
    ['redis+sentinel://h1:26379/', /the path must be \/<service>/],
    ['redis+sentinel://h1/a/b/c', /the path must be \/<service>/],
    ['redis+sentinel://h1/pq/x', /the path must be \/<service>/],
    ['redis+sentinel://h1:port/pq', /is not host:port/],
    ['redis+sentinel:///pq', /names no Sentinel/],
    ['redis+sentinel://h1/pq?socket_timeout=1', /unknown option "socket_timeout"/],
    ['redis+sentinel://app:pw@h1:port/pq', /app:\*\*\*@/], // the password is not in the message
  ]) {
    test(`a bad URL is refused clearly: ${url}`, () => {
      assert.throws(() => new Client({ url }), (e) => e instanceof TypeError && /Sentinel URL/.test(e.message)
        && needle.test(e.message) && !e.message.includes(':pw@'));
    });
  }
});

// A primary, its replica and one Sentinel that knows both (the replica in sync): ready for a failover.
async function sentinelSet() {
  const primary = await startRedis();
  const replica = await startRedis('--replicaof', '127.0.0.1', String(primary.port));
  const sentinel = await startSentinel(primary.port);
  const r = createClient({ url: replica.url }).on('error', () => {});
  await r.connect();
  await waitFor('the replica in sync', async () => (await r.info('replication')).includes('master_link_status:up'));
  await r.close();
  // Sentinel learns of the replica from the primary's INFO (every 10 s at first): a failover needs it known.
  await waitFor('Sentinel to know the replica', async () => {
    const s = createClient({ url: `redis://127.0.0.1:${sentinel.port}` }).on('error', () => {});
    await s.connect();
    try {
      return (await s.sendCommand(['SENTINEL', 'REPLICAS', 'pq'])).length === 1;
    } finally {
      await s.close();
    }
  }, 30_000);
  return {
    primary,
    replica,
    sentinel,
    url: `redis+sentinel://127.0.0.1:${sentinel.port}/pq/0`,
    async stop() {
      await sentinel.stop();
      await replica.stop();
      await primary.stop();
    },
  };
}

describe('through Sentinel, across a failover', () => {
  let set;
  let primary;
  let replica;
  let sentinel;
  let url;
  before(async () => {
    set = await sentinelSet();
    ({ primary, replica, sentinel, url } = set);
  });
  after(async () => {
    await set?.stop();
  });

  test('submit, cancel and a result wait go to the primary, then to the promoted replica', async () => {
    const queue = randomQueue();
    const client = new Client({ url, queue });
    try {
      const job = await client.submit({ prompt: 'hi', max_tokens: 4 });
      assert.equal(await client.status(job.id), 'queued');
      // The primary holds it (not some other node).
      const p = createClient({ url: primary.url }).on('error', () => {});
      await p.connect();
      assert.equal(await p.sendCommand(['HGET', client.keys.job(job.id), 'state']), 'queued');
      await p.close();
      const waiting = client.result(job.id, { timeoutMs: 20_000 }); // a blocking read on a connection of its own
      assert.equal(await client.cancel(job.id), 'cancelled');
      assert.equal((await waiting).status, 'cancelled');

      await primary.stop(); // SIGKILL
      await waitFor('Sentinel to promote the replica', async () => (await sentinel.primaryPort()) === replica.port,
        30_000);
      // The next commands land on the new primary (node-redis follows Sentinel's switch).
      const again = await waitFor('a submit on the new primary', async () => {
        try {
          return await client.submit({ prompt: 'after', max_tokens: 4 });
        } catch {
          return null;
        }
      }, 30_000);
      assert.equal(await client.status(again.id), 'queued');
      assert.equal(await client.status(job.id), 'cancelled'); // replicated before the kill
      const r = createClient({ url: replica.url }).on('error', () => {});
      await r.connect();
      assert.equal(await r.sendCommand(['HGET', client.keys.job(again.id), 'state']), 'queued');
      await r.close();
    } finally {
      await client.close();
    }
  });
});

// The client rides through the failover (test/ride.test.js does the same through a restart): a producer submitting
// all along sees no error, and a result() wait that began on the old primary returns from the new one.
describe('riding through a Sentinel failover', { timeout: 300_000 }, () => {
  let set;
  before(async () => {
    set = await sentinelSet();
  });
  after(async () => {
    await set?.stop();
  });

  test('submits and a result wait ride through it', async () => {
    // Under load a Sentinel can sit in TILT for 30 s before it fails over: the grace allows for it.
    const client = new Client({ url: set.url, queue: randomQueue(), graceMs: 120_000 });
    const ids = [];
    const errors = [];
    let stop = false;
    try {
      const waited = await client.submit({ prompt: 'wait', max_tokens: 4 });
      const waiting = client.result(waited.id, { timeoutMs: 200_000 });
      const producer = (async () => {
        while (!stop) {
          try {
            ids.push((await client.submit({ prompt: 'hi', max_tokens: 4 })).id);
          } catch (e) {
            errors.push(e);
          }
        }
      })();
      await waitFor('20 submits', () => ids.length >= 20);
      await set.primary.stop(); // SIGKILL
      const atKill = ids.length;
      await waitFor('Sentinel to promote the replica', async () => (await set.sentinel.primaryPort()) === set.replica.port,
        120_000);
      await waitFor('20 submits on the new primary', () => ids.length >= atKill + 20 || errors.length, 150_000);
      stop = true;
      await producer;
      assert.deepEqual(errors, []);
      assert.equal(new Set(ids).size, ids.length);
      // Cancelled on the new primary: the wait that began on the old one sees its end there.
      assert.equal(await client.cancel(waited.id), 'cancelled');
      assert.equal((await waiting).status, 'cancelled');
      const r = createClient({ url: set.replica.url }).on('error', () => {});
      await r.connect();
      const queued = (await r.sendCommand(['XRANGE', client.keys.stream('default'), '-', '+'])).map(([, f]) => f[1]);
      await r.close();
      assert.equal(new Set(queued).size, queued.length, 'no job queued twice by a retried submit');
      // Asynchronous replication: what the old primary had not sent is gone; every submit acknowledged once the
      // replica took over is there.
      const lost = ids.slice(atKill + 1).filter((id) => !queued.includes(id));
      assert.deepEqual(lost, []);
    } finally {
      stop = true;
      await client.close();
    }
  });
});

test('no primary to fail over to: RedisUnavailable after the grace, not a wait for ever', { timeout: 120_000 }, async () => {
  // node-redis's RedisSentinel holds a command without an error until the Sentinels name a primary: the client
  // gives such a try up at the end of its grace.
  const primary = await startRedis();
  const sentinel = await startSentinel(primary.port);
  const client = new Client({ url: `redis+sentinel://127.0.0.1:${sentinel.port}/pq/0`, queue: randomQueue(),
    graceMs: 1000 });
  try {
    await client.submit({ prompt: 'x', max_tokens: 4 });
    await primary.stop();
    const t0 = Date.now();
    const err = await client.submit({ prompt: 'y', max_tokens: 4 }).then(() => null, (e) => e);
    assert.ok(err instanceof RedisUnavailable, String(err));
    assert.match(err.message, /^Redis at redis\+sentinel:\/\/127\.0\.0\.1:\d+\/pq\/0 unreachable for /);
    assert.ok(Date.now() - t0 < 30_000);
  } finally {
    await client.close();
    await sentinel.stop();
  }
});
