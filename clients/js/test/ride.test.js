// The client rides through a Redis outage (producer/ride.py's twin; the Python side's tests are
// tests/faults/test_client_ride_through.py): a real redis-server with an append-only file synced on every write,
// stopped and started again on the same port mid-test. Submits keep succeeding without duplicates, result() and
// stream() keep waiting and resume where they were, and past the grace the error says what happened. Limits are
// against a hang, not a pace: nothing here asserts on speed beyond "not after the grace".
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import {
  ClientClosedError, ConnectionTimeoutError, ErrorReply, ReconnectStrategyError, SocketClosedUnexpectedlyError,
  SocketTimeoutError, createClient as createRedis,
} from 'redis';
import {
  Client, DEFAULT_GRACE_MS, DuplicateJobError, PagedqError, RedisUnavailable, TimeoutError, newId,
} from '../src/index.js';
import { isOutage, reconnectStrategy } from '../src/ride.js';
import { randomQueue, startAofRedis, startHookedWorker, startRedis, waitFor } from './helpers.js';

const LIMIT = { timeout: 300_000 };
const LONG = { prompt: 'ride', max_tokens: 120, ignore_eos: true, temperature: 0 };

async function rawClient(url) {
  const r = createRedis({ url }).on('error', () => {});
  await r.connect();
  return r;
}

// Every job key of `client`'s queue, and the length of its default lane's stream.
async function jobsStored(url, client) {
  const r = await rawClient(url);
  try {
    let n = 0;
    for await (const keys of r.scanIterator({ MATCH: client.keys.job('*'), COUNT: 1000 })) n += keys.length;
    return [Number(await r.sendCommand(['XLEN', client.keys.stream('default')])), n];
  } finally {
    await r.close();
  }
}

describe('what counts as an outage', () => {
  test('a server away for now', () => {
    const refused = Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:6379'), { code: 'ECONNREFUSED' });
    for (const e of [refused, Object.assign(new Error('read ECONNRESET'), { code: 'ECONNRESET' }),
      new SocketClosedUnexpectedlyError(), new ClientClosedError(), new ConnectionTimeoutError(),
      new ErrorReply('LOADING Redis is loading the dataset in memory'),
      new ErrorReply("READONLY You can't write against a read only replica."),
      new Error('Master Client (127.0.0.1:1): Socket closed unexpectedly', { cause: new SocketClosedUnexpectedlyError() }),
      new Error('None of the sentinels are available')]) {
      assert.ok(isOutage(e), e.message);
    }
  });

  test('a refusal or a mistake', () => {
    const cert = Object.assign(new Error('unable to verify the first certificate'),
      { code: 'UNABLE_TO_VERIFY_LEAF_SIGNATURE' });
    const wrong = new ErrorReply('WRONGPASS invalid username-password pair or user is disabled.');
    for (const e of [wrong, new ErrorReply('NOAUTH Authentication required.'),
      new ErrorReply('NOPERM User x has no permissions to run the \'get\' command'), cert,
      new ReconnectStrategyError(wrong, wrong), new ErrorReply('WRONGTYPE Operation against a key'),
      new ErrorReply('DUPLICATE job x exists (state queued)'), new TypeError('x'), null, undefined]) {
      assert.ok(!isOutage(e), String(e?.message));
    }
  });

  test('the connections keep reconnecting through an outage, and stop on a refusal', () => {
    for (const retries of [0, 1, 5, 50, 5000]) {
      for (const cause of [new SocketTimeoutError(5000), new SocketClosedUnexpectedlyError(),
        Object.assign(new Error('connect ECONNREFUSED'), { code: 'ECONNREFUSED' })]) {
        const ms = reconnectStrategy(retries, cause); // node-redis's own strategy gives up on a socket timeout
        assert.ok(typeof ms === 'number' && ms >= 0 && ms <= 1000, `${retries}: ${ms}`);
      }
    }
    const wrong = new ErrorReply('WRONGPASS invalid username-password pair or user is disabled.');
    assert.equal(reconnectStrategy(0, wrong), wrong);
  });

  test('the grace option', () => {
    assert.equal(DEFAULT_GRACE_MS, 30_000);
    assert.equal(new Client({ url: 'redis://127.0.0.1:1/0' }).graceMs, 30_000);
    for (const bad of [-1, NaN, Infinity, '30', null]) {
      assert.throws(() => new Client({ url: 'redis://127.0.0.1:1/0', graceMs: bad }),
        (e) => e instanceof TypeError && /graceMs must be milliseconds >= 0/.test(e.message));
    }
  });
});

// A node-redis client whose submit replies get lost: `mode` 'after': the script ran, its reply is lost (the
// connection dropped on the way back); 'before': the connection dropped before it was sent. `drops`: how many.
class Lossy {
  constructor(real, mode, drops = 1) {
    Object.assign(this, { real, mode, drops });
  }

  get isOpen() { return this.real.isOpen; }

  get isReady() { return this.real.isReady; }

  on(event, listener) {
    this.real.on(event, listener);
    return this;
  }

  connect() { return this.real.connect(); }

  duplicate() { return this.real.duplicate(); }

  async sendCommand(args) {
    if (!this.drops || !String(args[0]).startsWith('EVAL')) return this.real.sendCommand(args);
    this.drops--; // before any await: a pipelined round trip sends its calls in one tick
    if (this.mode === 'after') {
      try {
        await this.real.sendCommand(args);
      } catch (err) {
        this.drops++; // NOSCRIPT: nothing ran, the EVAL that follows is the one to lose
        throw err;
      }
    }
    throw new SocketClosedUnexpectedlyError();
  }
}

// A redis-server and a plain client on it, for a describe block's tests: started before them, stopped after.
function plainRedis() {
  const it = {};
  before(async () => {
    it.srv = await startRedis();
    it.raw = await rawClient(it.srv.url);
  });
  after(async () => {
    await it.raw?.close();
    await it.srv?.stop();
  });
  return it;
}

describe('a retried submit', LIMIT, () => {
  const redis = plainRedis();

  test('that finds its own job succeeds; another job under that id is still a duplicate', async () => {
    const queue = randomQueue();
    const lossy = new Lossy(await rawClient(redis.srv.url), 'after');
    const c = new Client({ redis: lossy, queue, graceMs: 10_000 });
    const job = await c.submit({ prompt: 'x', max_tokens: 4 });
    assert.equal(lossy.drops, 0, 'the first reply was lost');
    assert.equal(await c.status(job.id), 'queued');
    // The same id, another payload, after a dropped connection: someone else's job.
    const other = new Client({ redis: new Lossy(lossy.real, 'before'), queue, graceMs: 10_000 });
    await assert.rejects(other.submit({ id: job.id, prompt: 'other', max_tokens: 4 }),
      (e) => e instanceof DuplicateJobError && e.ids[0] === job.id);
    // No retry: a plain duplicate, even of the same payload.
    await assert.rejects(new Client({ redis: lossy.real, queue }).submit({ id: job.id, prompt: 'x', max_tokens: 4 }),
      DuplicateJobError);
    assert.equal(await redis.raw.sendCommand(['XLEN', c.keys.stream('default')]), 1);

    // submitMany: a round trip re-sent after a lost reply finds its own jobs, and submits the rest.
    lossy.drops = 1;
    const ids = [newId(), newId(), newId()];
    const jobs = await c.submitMany(ids.map((id) => ({ id, prompt: 'y', max_tokens: 4 })));
    assert.deepEqual(jobs.map((j) => j.id), ids);
    assert.equal(lossy.drops, 0);
    const dup = new Client({ redis: new Lossy(lossy.real, 'before'), queue, graceMs: 10_000 });
    await assert.rejects(dup.submitMany([{ id: ids[0], prompt: 'z', max_tokens: 4 }, { prompt: 'new', max_tokens: 4 }]),
      (e) => e instanceof DuplicateJobError && e.ids.join() === ids[0] && e.jobs.length === 1);
    assert.equal(await redis.raw.sendCommand(['XLEN', c.keys.stream('default')]), 5);
    await lossy.real.close();
  });
});

describe('through a Redis restart', LIMIT, () => {
  let srv;
  before(async () => {
    srv = await startAofRedis();
  });
  after(async () => {
    await srv?.stop();
  });

  test('a producer submitting all along: no submit fails, no duplicate, every acknowledged job stored', async () => {
    const c = new Client({ url: srv.url, queue: randomQueue() });
    const ids = [];
    const errors = [];
    const waits = [];
    let stop = false;
    const producer = (async () => {
      while (!stop) {
        const t0 = Date.now();
        try {
          ids.push((await c.submit({ prompt: 'hi', max_tokens: 4 })).id);
        } catch (e) {
          errors.push(e);
        }
        waits.push(Date.now() - t0);
      }
    })();
    await waitFor('20 submits', () => ids.length >= 20);
    await srv.restart(2000);
    const at = ids.length;
    await waitFor('20 more submits', () => ids.length >= at + 20 || errors.length, 120_000);
    stop = true;
    await producer;
    assert.deepEqual(errors, []);
    assert.ok(Math.max(...waits) >= 1500, 'a submit really waited out the outage');
    assert.equal(new Set(ids).size, ids.length);
    assert.deepEqual(await jobsStored(srv.url, c), [ids.length, ids.length]); // every acknowledged job, once
    await c.close();
  });
});

describe('result() and stream() through a Redis restart', LIMIT, () => {
  let srv;
  let worker;
  const queue = randomQueue();
  before(async () => {
    srv = await startAofRedis();
    worker = startHookedWorker({ 'step-delay-ms': 30 }, srv.url, queue, '--max-model-len', '256', '--lease-ms', '3000');
  });
  after(async () => {
    const log = worker?.log() ?? '';
    await worker?.stop();
    await srv?.stop();
    if (worker && ![0, 'SIGTERM'].includes(worker.exitCode)) console.log(`worker exited with ${worker.exitCode}:\n${log.slice(-5000)}`);
  });

  test('a result wait returns; a stream yields every token once', async () => {
    const seen = [];
    const c = new Client({ url: srv.url, queue, onError: (e) => seen.push(e) });
    const [waited, streamed] = await c.submitMany([{ ...LONG, id: `${queue}-0` }, { ...LONG, id: `${queue}-1` }]);
    const result = waited.result({ timeoutMs: 200_000 });
    const events = (async () => {
      const out = [];
      for await (const ev of streamed.stream({ timeoutMs: 200_000 })) out.push(ev);
      return out;
    })();
    const probe = await rawClient(srv.url);
    await waitFor('tokens on the stream', async () => (await probe.sendCommand(['XLEN', c.keys.events(streamed.id)])) >= 3,
      200_000);
    assert.equal(await probe.sendCommand(['EXISTS', c.keys.result(streamed.id)]), 0, 'the restart comes mid-stream');
    await probe.close();
    await srv.restart(2000);
    const res = await result;
    assert.equal(res.status, 'completed');
    assert.equal(res.token_ids.length, LONG.max_tokens);
    const evs = await events;
    assert.equal(evs.filter((e) => e.type !== 'token').length, 1);
    assert.notEqual(evs.at(-1).type, 'token');
    assert.equal(new Set(evs.map((e) => e.event_id)).size, evs.length);
    const final = await c.result(streamed.id, { timeoutMs: 10_000 });
    assert.equal(final.status, 'completed');
    // Every token once, in order: what the stream yielded is the job's output.
    assert.deepEqual(evs.slice(0, -1).flatMap((e) => e.token_ids), final.token_ids);
    assert.equal(evs.slice(0, -1).map((e) => e.text).join(''), final.text);
    assert.ok(seen.length, 'the outage reached the client');
    await c.close();
  });
});

describe('past the grace, or refused', LIMIT, () => {
  test('Redis stopped for good: RedisUnavailable names it and how long it waited', async () => {
    const srv = await startRedis('--requirepass', 's3cret');
    const url = `redis://:s3cret@127.0.0.1:${srv.port}/0`;
    const c = new Client({ url, queue: randomQueue(), graceMs: 1500 });
    await c.submit({ prompt: 'x', max_tokens: 4 });
    await srv.down();
    try {
      const t0 = Date.now();
      const err = await c.submit({ prompt: 'y', max_tokens: 4 }).then(() => null, (e) => e);
      const took = Date.now() - t0;
      assert.ok(err instanceof RedisUnavailable && err instanceof PagedqError, String(err));
      assert.ok(took >= 1500 && took < 1500 + 15_000, `${took} ms`);
      assert.match(err.message, new RegExp(`^Redis at redis://:\\*\\*\\*@127\\.0\\.0\\.1:${srv.port}/0 unreachable `
        + 'for \\d+\\.?\\d* s \\(the client\'s grace is 1\\.5 s\\): '));
      assert.ok(!err.message.includes('s3cret'));
      assert.ok(err.waited >= 1.5 && err.waited < 20, String(err.waited));
      // A result() timeout shorter than the grace ends the wait first.
      const long = new Client({ url, queue: randomQueue(), graceMs: 30_000 });
      await assert.rejects(long.result('nope', { timeoutMs: 500 }), TimeoutError);
      await long.close();
      // graceMs 0: no retries.
      const none = new Client({ url, queue: randomQueue(), graceMs: 0 });
      const t1 = Date.now();
      await assert.rejects(none.status('nope'), RedisUnavailable);
      assert.ok(Date.now() - t1 < 15_000);
      await none.close();
    } finally {
      await c.close();
      await srv.stop();
    }
  });

  test('a wrong password fails at once, not after the grace', async () => {
    const srv = await startRedis('--requirepass', 'right');
    try {
      for (const url of [`redis://:wrong@127.0.0.1:${srv.port}/0`, srv.url]) {
        const c = new Client({ url, queue: randomQueue() });
        const t0 = Date.now();
        const err = await c.status('x').then(() => null, (e) => e);
        assert.ok(err && !(err instanceof RedisUnavailable) && /WRONGPASS|NOAUTH/.test(err.message), String(err));
        assert.ok(Date.now() - t0 < c.graceMs / 2, 'refused at once');
        await c.close();
      }
    } finally {
      await srv.stop();
    }
  });
});

describe('a stream followed across a failover that lost its last chunks', LIMIT, () => {
  const redis = plainRedis();

  // Written by hand: the chunks the reader had from the old primary come again under new entry ids (the worker
  // heals the stream on the promoted replica); the reader yields each token once.
  test('skips the chunks written again', async () => {
    const c = new Client({ url: redis.srv.url, queue: randomQueue() });
    const key = c.keys.events('j');
    const chunk = (offset, ...ids) => redis.raw.sendCommand(['XADD', key, '*', 'e',
      JSON.stringify({ type: 'token', text: ids.join(''), token_ids: ids }), 'o', String(offset)]);
    await chunk(0, 0, 1);
    await chunk(2, 2, 3);
    const got = [];
    const reading = (async () => {
      for await (const ev of c.stream('j', { timeoutMs: 60_000 })) got.push(ev);
    })();
    await waitFor('the reader has both chunks', () => got.length === 2, 10_000);
    await chunk(2, 2, 3); // again, as after the failover
    await chunk(4, 4);
    const result = { id: 'j', status: 'completed', token_ids: [0, 1, 2, 3, 4] };
    await redis.raw.sendCommand(['XADD', key, '*', 'e', JSON.stringify({ type: 'done', result })]);
    await reading;
    assert.deepEqual(got.slice(0, -1).flatMap((e) => e.token_ids), [0, 1, 2, 3, 4]);
    assert.deepEqual(got.slice(0, -1).map((e) => e.offset), [0, 2, 4]);
    assert.equal(got.at(-1).type, 'done');
    await c.close();
  });
});
