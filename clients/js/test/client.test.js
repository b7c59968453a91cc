// The client against a real redis-server and a real pagedq worker on a tiny random-weight model. Every wait is
// for a state (a result, an event, a job state), never for a fixed time.
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { createClient as createRedis } from 'redis';
import { Client, DuplicateJobError, InvalidRequestError, JobNotFound, TimeoutError, newId } from '../src/index.js';
import { JSON_SCHEMA, SCHEMA, randomQueue, startRedis, startWorker, waitFor } from './helpers.js';

let srv;
let worker;
let client; // on the queue the worker serves
let idle; // on a queue no worker serves: its jobs stay queued
let raw; // a plain node-redis connection, to look at the keys

async function collect(iterable) {
  const out = [];
  for await (const ev of iterable) out.push(ev);
  return out;
}

// A job's events as they lie in Redis: exactly one terminal event, last; the token texts make up the result.
function checkEvents(events) {
  assert.ok(events.length >= 1);
  const last = events.at(-1);
  assert.equal(events.filter((e) => e.type !== 'token').length, 1, events.map((e) => e.type).join());
  assert.notEqual(last.type, 'token');
  const tokens = events.slice(0, -1);
  assert.equal(tokens.map((e) => e.text).join(''), last.result.text);
  assert.deepEqual(tokens.flatMap((e) => e.token_ids), last.result.token_ids);
  return last;
}

// Limits against a hang, not a pace: a loaded CI machine takes far less than these.
const LIMIT = { timeout: 240_000 };

before(async () => {
  srv = await startRedis();
  const queue = randomQueue();
  worker = startWorker(srv.url, queue);
  client = new Client({ url: srv.url, queue });
  idle = new Client({ url: srv.url, queue: randomQueue('idle') });
  raw = createRedis({ url: srv.url }).on('error', () => {});
  await raw.connect();
}, LIMIT);

after(async () => {
  await client?.close();
  await idle?.close();
  await raw?.close();
  const log = worker?.log() ?? '';
  await worker?.stop();
  await srv?.stop();
  if (worker && ![0, 'SIGTERM'].includes(worker.exitCode)) console.log(`worker exited with ${worker.exitCode}:\n${log.slice(-5000)}`);
}, LIMIT);

describe('submit and result', LIMIT, () => {
  test('a job runs to completion; status follows it', async () => {
    const job = await client.submit({ prompt: 'Hello there', max_tokens: 6, metadata: { user: 'u1' } });
    assert.match(job.id, /^[0-9a-f]{32}$/);
    assert.ok(['queued', 'running', 'completed'].includes(await job.status()));
    const res = await job.result({ timeoutMs: 120_000 });
    assert.equal(res.id, job.id);
    assert.equal(res.status, 'completed');
    assert.equal(res.token_ids.length, 6);
    assert.equal(res.finish_reason, 'length');
    assert.equal(res.usage.completion_tokens, 6);
    assert.deepEqual(res.metadata, { user: 'u1' });
    assert.equal(res.error, null);
    assert.equal(await job.status(), 'completed');
    assert.deepEqual(await client.result(job.id), res, 'a second read gives the stored result');
  });

  test('chat messages, a given id, and the wire format the worker reads', async () => {
    const id = `js-${newId()}`;
    const job = await client.submit({ id, messages: [{ role: 'user', content: 'Hi!' }], max_tokens: 3, temperature: 0 });
    assert.equal(job.id, id);
    const entries = await raw.sendCommand(['XRANGE', client.keys.jobs, '-', '+']);
    const mine = entries.map(([, f]) => f).find((f) => f[1] === id);
    if (mine) { // the worker may have taken (and deleted) the entry already
      assert.deepEqual(mine.slice(0, 3), ['id', id, 'job']);
      assert.deepEqual(JSON.parse(mine[3]), { id, messages: [{ role: 'user', content: 'Hi!' }], max_tokens: 3, temperature: 0 });
    }
    const res = await job.result({ timeoutMs: 120_000 });
    assert.equal(res.status, 'completed');
    assert.equal(res.token_ids.length, 3);
  });

  test('submitMany submits a batch in one go', async () => {
    const jobs = await client.submitMany([1, 2, 3, 4].map((n) => ({ prompt: `Count to ${n}`, max_tokens: n })));
    assert.equal(new Set(jobs.map((j) => j.id)).size, 4);
    const results = await Promise.all(jobs.map((j) => j.result({ timeoutMs: 120_000 })));
    assert.deepEqual(results.map((r) => [r.id, r.status, r.token_ids.length]),
      jobs.map((j, i) => [j.id, 'completed', i + 1]));
    assert.deepEqual(await client.submitMany([]), []);
  });

  test('a duplicate id is refused, by submit and by submitMany (which submits the others)', async () => {
    const id = `dup-${newId()}`;
    await idle.submit({ id, prompt: 'first' });
    await assert.rejects(idle.submit({ id, prompt: 'second' }), (err) => {
      assert.ok(err instanceof DuplicateJobError);
      assert.deepEqual(err.ids, [id]);
      assert.match(err.message, new RegExp(id));
      return true;
    });
    const fresh = [`ok-${newId()}`, `ok-${newId()}`];
    await assert.rejects(idle.submitMany([{ id: fresh[0], prompt: 'a' }, { id, prompt: 'b' }, { id: fresh[1], prompt: 'c' }]),
      (err) => {
        assert.ok(err instanceof DuplicateJobError);
        assert.deepEqual(err.ids, [id]);
        assert.deepEqual(err.jobs.map((j) => j.id), fresh);
        return true;
      });
    for (const f of fresh) assert.equal(await idle.status(f), 'queued');
    // The refused submit changed nothing: one job, one stream entry.
    const entries = await raw.sendCommand(['XRANGE', idle.keys.jobs, '-', '+']);
    assert.equal(entries.filter(([, f]) => f[1] === id).length, 1);
    assert.equal(JSON.parse(entries.find(([, f]) => f[1] === id)[1][3]).prompt, 'first');
  });

  test('n continuations: token events say which, a per-choice stream keeps one, the result has them all', async () => {
    const job = await client.submit({ prompt: 'Two ways', n: 2, max_tokens: 5, temperature: 0.9, seed: 3,
      ignore_eos: true });
    const res = await job.result();
    assert.equal(res.status, 'completed');
    assert.deepEqual(res.choices.map((c) => c.index), [0, 1]);
    assert.equal(res.text, res.choices[0].text);
    assert.equal(res.usage.completion_tokens, 10);
    const all = await collect(job.stream());
    for (const choice of res.choices) {
      const mine = all.filter((e) => e.type === 'token' && e.index === choice.index);
      assert.deepEqual(mine.flatMap((e) => e.token_ids), choice.token_ids);
      assert.equal(mine.at(-1).finish_reason, 'length');
    }
    const one = await collect(job.stream({ choice: 1 }));
    assert.equal(one.slice(0, -1).map((e) => e.text).join(''), res.choices[1].text);
    assert.ok(one.slice(0, -1).every((e) => e.index === 1) && one.at(-1).type === 'done');
  });

  test('a bad request is refused before it reaches Redis', async () => {
    const before = await raw.sendCommand(['XLEN', idle.keys.jobs]);
    await assert.rejects(idle.submit({ prompt: 'x', max_tokens: 0 }),
      { name: 'InvalidRequestError', field: 'max_tokens', message: /max_tokens: must be >= 1/ });
    await assert.rejects(idle.submit({ max_tokens: 5 }), /give exactly one of prompt or messages/);
    await assert.rejects(idle.submitMany([{ prompt: 'fine' }, { prompt: 'x', temprature: 0 }]),
      (err) => err instanceof InvalidRequestError && err.field === 'temprature' && /unknown field/.test(err.message));
    assert.equal(await raw.sendCommand(['XLEN', idle.keys.jobs]), before, 'nothing was enqueued');
  });

  test('a job the worker refuses ends failed, with error.type set', async () => {
    const job = await client.submit({ prompt: 'x', max_tokens: 4, model: 'no-such-model' });
    const res = await job.result({ timeoutMs: 120_000 });
    assert.equal(res.status, 'failed');
    assert.equal(res.finish_reason, 'error');
    assert.equal(res.error.type, 'unknown_model');
    assert.match(res.error.message, /no-such-model/);
    assert.equal(await job.status(), 'failed');
    const events = await collect(job.stream());
    assert.deepEqual(events.map((e) => e.type), ['error']);
    assert.equal(events[0].result.error.type, 'unknown_model');
  });

  test('unknown ids: JobNotFound', async () => {
    for (const call of [(id) => client.status(id), (id) => client.result(id), (id) => client.cancel(id),
      (id) => collect(client.stream(id))]) {
      await assert.rejects(call(`nope-${newId()}`), JobNotFound);
    }
  });

  test('result and stream time out on a job that does not finish', async () => {
    const job = await idle.submit({ prompt: 'wait', max_tokens: 2 });
    await assert.rejects(job.result({ timeoutMs: 50 }), TimeoutError);
    await assert.rejects(collect(job.stream({ timeoutMs: 50 })), TimeoutError);
    const ac = new AbortController();
    const waiting = job.result({ signal: ac.signal });
    ac.abort(new Error('client went away'));
    await assert.rejects(waiting, /client went away/);
    assert.equal(await job.status(), 'queued', 'the job goes on');
  });
});

describe('stream', LIMIT, () => {
  test('tokens, then exactly one terminal event; resumes after any event id', async () => {
    const job = await client.submit({ prompt: 'Once upon a time', max_tokens: 12 });
    const live = await collect(job.stream({ timeoutMs: 120_000 }));
    const last = checkEvents(live);
    assert.equal(last.type, 'done');
    assert.equal(last.result.status, 'completed');
    assert.deepEqual(last.result, await job.result());
    assert.equal(live.filter((e) => e.type === 'token').map((e) => e.text).join(''), (await job.result()).text);
    assert.ok(live.every((e) => /^\d+-\d+$/.test(e.event_id)));

    // Resume: after event k, the rest, nothing twice (as a browser reconnecting with Last-Event-ID).
    for (const k of [0, Math.floor(live.length / 2), live.length - 2]) {
      const rest = await collect(job.stream({ after: live[k].event_id }));
      assert.deepEqual(rest, live.slice(k + 1));
    }
    // After the terminal event there is nothing more: the stream ends at once.
    assert.deepEqual(await collect(job.stream({ after: last.event_id })), []);
    assert.deepEqual(await collect(job.stream()), live, 'a late reader gets everything from the start');
  });

  test('a reader that joins while the job is queued gets every event', async () => {
    const q = randomQueue('late');
    const c = new Client({ url: srv.url, queue: q });
    const job = await c.submit({ prompt: 'Later', max_tokens: 5 });
    const reading = collect(job.stream({ timeoutMs: 120_000 }));
    const w = startWorker(srv.url, q);
    try {
      const events = await reading;
      const last = checkEvents(events);
      assert.equal(last.result.token_ids.length, 5);
    } finally {
      await c.close();
      await w.stop();
    }
  });

  test('many streams at once do not hold up other commands', async () => {
    const waiting = await Promise.all([1, 2, 3].map(() => idle.submit({ prompt: 'x', max_tokens: 1 })));
    const ac = new AbortController();
    const readers = waiting.map((j) => collect(j.stream({ signal: ac.signal })));
    // While three XREAD BLOCKs wait, a job on the main connection still runs end to end.
    const res = await (await client.submit({ prompt: 'meanwhile', max_tokens: 2 })).result({ timeoutMs: 120_000 });
    assert.equal(res.status, 'completed');
    ac.abort();
    for (const r of readers) await assert.rejects(r, { name: 'AbortError' });
  });
});

describe('lanes and groups', LIMIT, () => {
  // A queue no worker serves, its own: every key it holds is one these tests wrote.
  let lanes;
  before(() => { lanes = new Client({ url: srv.url, queue: randomQueue('lanes') }); });
  after(() => lanes?.close());

  const keysOf = async (c) => (await raw.sendCommand(['KEYS', `${c.keys.base}:*`])).map(String).sort();
  const ids = async (stream) => (await raw.sendCommand(['XRANGE', stream, '-', '+'])).map(([, f]) => f[1]);
  const members = async (set) => (await raw.sendCommand(['SMEMBERS', set])).map(String).sort();

  test('a job lands on its lane\'s stream; a lane\'s own stream registers no group', async () => {
    const k = lanes.keys;
    const jobs = {};
    for (const lane of ['interactive', 'default', 'batch']) {
      jobs[lane] = await lanes.submit({ prompt: `on ${lane}`, max_tokens: 2, lane });
      assert.equal(await jobs[lane].status(), 'queued');
    }
    assert.equal(k.stream('interactive'), `${k.jobs}:interactive`);
    for (const [lane, job] of Object.entries(jobs)) {
      assert.deepEqual(await ids(k.stream(lane)), [job.id], lane);
      assert.equal(String(await raw.sendCommand(['HGET', k.job(job.id), 'stream'])), k.stream(lane));
      const [, fields] = (await raw.sendCommand(['XRANGE', k.stream(lane), '-', '+']))[0];
      const wire = JSON.parse(fields[3]);
      assert.equal(wire.lane, lane === 'default' ? undefined : lane, 'the default lane is left out, as Python does');
      assert.equal(wire.group, undefined);
      assert.deepEqual(await members(k.laneGroups(lane)), []);
      assert.deepEqual(await members(k.ready(lane)), []);
    }
    assert.equal(await raw.sendCommand(['EXISTS', k.bell]), 0, 'no group, no bell');
  });

  test('a job with a group lands on the group\'s stream in its lane, registered and ready, the bell rung', async () => {
    const k = lanes.keys;
    const before = await raw.sendCommand(['XLEN', k.bell]);
    const a = await lanes.submit({ id: `g-${newId()}`, prompt: 'tenant job', max_tokens: 2, lane: 'batch',
      group: 'acme' });
    const [b, c] = await lanes.submitMany([
      { prompt: 'same tenant', lane: 'batch', group: 'acme' },
      { prompt: 'another tenant, default lane', group: 'org:42@eu' },
    ]);
    assert.equal(k.stream('batch', 'acme'), `${k.jobs}:batch:acme`);
    assert.deepEqual(await ids(k.stream('batch', 'acme')), [a.id, b.id]);
    assert.deepEqual(await ids(k.stream('default', 'org:42@eu')), [c.id]);
    assert.ok(!(await ids(k.stream('batch'))).includes(a.id), 'not on the lane\'s own stream');
    assert.equal(String(await raw.sendCommand(['HGET', k.job(a.id), 'stream'])), k.stream('batch', 'acme'));
    assert.deepEqual(await members(k.laneGroups('batch')), ['acme']);
    assert.deepEqual(await members(k.ready('batch')), ['acme']);
    assert.deepEqual(await members(k.laneGroups('default')), ['org:42@eu']);
    assert.deepEqual(await members(k.ready('default')), ['org:42@eu']);
    assert.deepEqual(await members(k.ready('interactive')), []);
    const rung = (await raw.sendCommand(['XRANGE', k.bell, '-', '+'])).slice(Number(before))
      .map(([, f]) => f.map(String));
    assert.deepEqual(rung, [['g', 'acme'], ['g', 'acme'], ['g', 'org:42@eu']]);
    const [, fields] = (await raw.sendCommand(['XRANGE', k.stream('batch', 'acme'), '-', '+']))[0];
    assert.deepEqual(JSON.parse(fields[3]),
      { id: a.id, prompt: 'tenant job', max_tokens: 2, lane: 'batch', group: 'acme' });
  });

  test('a bad lane or group is refused before anything is written', async () => {
    const c = new Client({ url: srv.url, queue: randomQueue('badlane') });
    try {
      await assert.rejects(c.submit({ prompt: 'x', lane: 'urgent' }),
        { name: 'InvalidRequestError', field: 'lane', message: /lane: must be one of interactive, default, batch/ });
      await assert.rejects(c.submit({ prompt: 'x', lane: 'batch', group: 'has space' }),
        { name: 'InvalidRequestError', field: 'group', message: /group: must be 1-128 characters of/ });
      await assert.rejects(c.submit({ prompt: 'x', group: 'ten{ant}' }), { field: 'group' });
      await assert.rejects(c.submitMany([{ prompt: 'fine', lane: 'batch', group: 'ok' }, { prompt: 'x', lane: null }]),
        { field: 'lane' });
      await assert.rejects(c.submitMany([{ prompt: 'fine' }, { prompt: 'x', group: 'g'.repeat(129) }]),
        { field: 'group' });
      assert.deepEqual(await keysOf(c), [], 'no key of the queue exists');
    } finally {
      await c.close();
    }
  });

  test('a queued job on a lane or group is cancelled; its entry stays for the worker to skip', async () => {
    const k = lanes.keys;
    const job = await lanes.submit({ prompt: 'never runs', lane: 'interactive', group: 'acme' });
    assert.equal(await job.cancel(), 'cancelled');
    assert.equal(await job.status(), 'cancelled');
    assert.equal((await job.result({ timeoutMs: 1000 })).finish_reason, 'cancelled');
    // cancel.lua deletes a queued job's entry on the default lane's stream only.
    assert.ok((await ids(k.stream('interactive', 'acme'))).includes(job.id));
  });
});

describe('cancel', LIMIT, () => {
  test('a queued job is cancelled at once', async () => {
    const job = await idle.submit({ prompt: 'never runs', max_tokens: 4 });
    assert.equal(await job.status(), 'queued');
    assert.equal(await job.cancel(), 'cancelled');
    assert.equal(await job.status(), 'cancelled');
    const res = await job.result({ timeoutMs: 1000 });
    assert.equal(res.status, 'cancelled');
    assert.equal(res.finish_reason, 'cancelled');
    assert.equal(res.id, job.id);
    assert.ok(res.timings.finished_at > 0);
    const events = await collect(job.stream());
    assert.deepEqual(events.map((e) => e.type), ['cancelled']);
    assert.equal(await job.cancel(), 'cancelled', 'a second cancel reports the final state');
    const entries = await raw.sendCommand(['XRANGE', idle.keys.jobs, '-', '+']);
    assert.ok(!entries.some(([, f]) => f[1] === job.id), 'its stream entry is gone');
  });

  test('a running job is stopped by its worker', async () => {
    const job = await client.submit({ prompt: 'Tell me a long story', max_tokens: 1500, ignore_eos: true });
    const events = [];
    let reply;
    for await (const ev of job.stream({ timeoutMs: 300_000 })) {
      events.push(ev);
      if (ev.type === 'token' && !reply) {
        assert.equal(await job.status(), 'running');
        reply = await job.cancel();
        assert.equal(reply, 'cancelling');
      }
    }
    const last = checkEvents(events);
    assert.equal(last.type, 'cancelled');
    assert.equal(last.result.status, 'cancelled');
    assert.equal(last.result.finish_reason, 'cancelled');
    assert.ok(last.result.token_ids.length < 1500);
    assert.equal(await job.status(), 'cancelled');
    assert.equal(await job.cancel(), 'cancelled');
  });

  test('a finished job keeps its state', async () => {
    const job = await client.submit({ prompt: 'short', max_tokens: 1 });
    await job.result({ timeoutMs: 120_000 });
    assert.equal(await job.cancel(), 'completed');
    assert.equal(await job.status(), 'completed');
  });
});

describe('scripts Redis lost', LIMIT, () => {
  test('after SCRIPT FLUSH, submit, submitMany and cancel load them again', async () => {
    await raw.sendCommand(['SCRIPT', 'FLUSH']);
    const one = await idle.submit({ prompt: 'a' });
    await raw.sendCommand(['SCRIPT', 'FLUSH']);
    const many = await idle.submitMany([{ prompt: 'b' }, { prompt: 'c' }]);
    await raw.sendCommand(['SCRIPT', 'FLUSH']);
    assert.equal(await one.cancel(), 'cancelled');
    for (const j of many) assert.equal(await j.status(), 'queued');
  });
});

describe('connections', LIMIT, () => {
  test('a node-redis client passed in is used and left open', async () => {
    const mine = createRedis({ url: srv.url }).on('error', () => {});
    const c = new Client({ redis: mine, queue: idle.queue });
    const job = await c.submit({ prompt: 'x' });
    assert.equal(await c.status(job.id), 'queued');
    await collect(c.stream(job.id, { timeoutMs: 10 })).catch(() => {});
    await c.close();
    assert.ok(mine.isOpen);
    assert.equal(await mine.sendCommand(['HGET', idle.keys.job(job.id), 'state']), 'queued');
    await mine.close();
  });

  test('waits until Redis connects; REDIS_URL is the default url', async () => {
    const saved = process.env.REDIS_URL;
    process.env.REDIS_URL = srv.url;
    try {
      const c = new Client({ queue: idle.queue });
      assert.equal(c.url, srv.url);
      const [a, b] = await Promise.all([c.submit({ prompt: 'x' }), c.submit({ prompt: 'y' })]);
      assert.equal(await c.status(a.id), 'queued');
      assert.equal(await c.status(b.id), 'queued');
      await c.close();
    } finally {
      if (saved === undefined) delete process.env.REDIS_URL;
      else process.env.REDIS_URL = saved;
    }
  });
});

// Structured output (validation: constraints.test.js). The tiny model's weights are random: its output fits only
// because every token the constraint does not allow is masked. Strings are bounded: else it may rarely close one.
describe('structured output', LIMIT, () => {
  test('guided_choice: the text is one of the choices, and ends with stop', async () => {
    const choices = ['yes', 'no', 'maybe later'];
    const jobs = await client.submitMany([
      { prompt: 'Is it?', guided_choice: choices, max_tokens: 16, seed: 1 },
      { prompt: 'Is it?', guided_choice: choices, max_tokens: 16, n: 3, seed: 2 },
    ]);
    const [one, three] = await Promise.all(jobs.map((j) => j.result({ timeoutMs: 120_000 })));
    assert.equal(one.status, 'completed', JSON.stringify(one.error));
    assert.ok(choices.includes(one.text), one.text);
    assert.equal(one.finish_reason, 'stop');
    assert.equal(three.choices.length, 3);
    for (const c of three.choices) {
      assert.ok(choices.includes(c.text), c.text);
      assert.equal(c.finish_reason, 'stop');
    }
  });

  test('response_format json_schema: the text parses and fits the schema; max_tokens cuts with length', async () => {
    const [whole, cut] = await client.submitMany([
      { prompt: 'Describe a thing as JSON.', response_format: JSON_SCHEMA, max_tokens: 200, seed: 3 },
      { prompt: 'Describe a thing as JSON.', response_format: JSON_SCHEMA, max_tokens: 3, seed: 3 },
    ]);
    const res = await whole.result({ timeoutMs: 120_000 });
    assert.equal(res.status, 'completed', JSON.stringify(res.error));
    assert.equal(res.finish_reason, 'stop', res.text);
    const obj = JSON.parse(res.text);
    assert.deepEqual(Object.keys(obj).sort(), ['color', 'count', 'tag']);
    assert.ok(['red', 'green', 'blue'].includes(obj.color), res.text);
    assert.ok(Number.isInteger(obj.count) && obj.count >= 0 && obj.count <= 99, res.text);
    assert.ok(typeof obj.tag === 'string' && [...obj.tag].length <= 6, res.text);
    assert.ok(res.text.startsWith('{"color":"'), `no free whitespace: ${res.text}`);
    assert.equal(checkEvents(await collect(whole.stream())).result.text, res.text, 'the last token shows in the stream too');

    const part = await cut.result({ timeoutMs: 120_000 });
    assert.equal(part.finish_reason, 'length');
    assert.equal(part.token_ids.length, 3);
    assert.ok(res.text.startsWith('{') && part.text.startsWith('{'), part.text);
  });

  test('a constraint that does not compile fails the job: invalid_request, the grammar engine\'s message', async () => {
    const job = await client.submit({ prompt: 'p', guided_regex: '(unclosed', max_tokens: 4 });
    const res = await job.result({ timeoutMs: 120_000 });
    assert.equal(res.status, 'failed');
    assert.equal(res.error.type, 'invalid_request');
    assert.match(res.error.message, /regex/i);
  });
});
