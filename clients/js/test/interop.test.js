// The JavaScript and Python clients share one protocol: a job submitted by one is read, streamed and
// cancelled by the other (python3 -c with producer.Client), and a real worker runs both.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { Client, newId } from '../src/index.js';
import { python, randomQueue, startRedis, startWorker } from './helpers.js';

let srv;
let worker;
let queue;
let idleQueue;
let client;
let idle;

// Runs `body` (Python, indented by 0) with `c` a producer.Client on `q`; it prints one JSON line.
function py(q, body) {
  return python(`
import json
from producer import Client
c = Client(${JSON.stringify(srv.url)}, queue=${JSON.stringify(q)})
${body}`);
}

// Limits against a hang, not a pace.
const LIMIT = { timeout: 240_000 };

before(async () => {
  srv = await startRedis();
  queue = randomQueue();
  idleQueue = randomQueue('idle');
  worker = startWorker(srv.url, queue);
  client = new Client({ url: srv.url, queue });
  idle = new Client({ url: srv.url, queue: idleQueue });
}, LIMIT);

after(async () => {
  await client?.close();
  await idle?.close();
  const log = worker?.log() ?? '';
  await worker?.stop();
  await srv?.stop();
  if (worker && ![0, 'SIGTERM'].includes(worker.exitCode)) console.log(`worker exited with ${worker.exitCode}:\n${log.slice(-5000)}`);
}, LIMIT);

test('a job submitted from JavaScript is read by the Python client', LIMIT, async () => {
  const job = await client.submit({ id: `js-${newId()}`, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 5,
    temperature: 0, metadata: { from: 'js' } });
  const mine = await job.result({ timeoutMs: 120_000 });
  const theirs = py(queue, `
res = c.job(${JSON.stringify(job.id)}).result(timeout=120)
events = list(c.stream(${JSON.stringify(job.id)}))
print(json.dumps({"status": c.status(${JSON.stringify(job.id)}), "result": json.loads(res.model_dump_json()),
                  "text": "".join(e.text for e in events if e.type == "token"),
                  "ids": [e.event_id for e in events], "types": [e.type for e in events]}))`);
  assert.equal(theirs.status, 'completed');
  assert.deepEqual(theirs.result, mine);
  assert.deepEqual(theirs.result.metadata, { from: 'js' });
  assert.equal(theirs.text, mine.text);
  const events = [];
  for await (const ev of job.stream()) events.push(ev);
  assert.deepEqual(theirs.ids, events.map((e) => e.event_id));
  assert.deepEqual(theirs.types, events.map((e) => e.type));
});

test('a job submitted from Python is read, streamed and resumed by the JavaScript client', LIMIT, async () => {
  const { id } = py(queue, `
job = c.submit(prompt="Once upon a time", max_tokens=6, stop=["zzz"], metadata={"from": "py"})
print(json.dumps({"id": job.id}))`);
  const events = [];
  for await (const ev of client.stream(id, { timeoutMs: 120_000 })) events.push(ev);
  const last = events.at(-1);
  assert.equal(last.type, 'done');
  assert.equal(events.filter((e) => e.type !== 'token').length, 1);
  assert.equal(events.slice(0, -1).map((e) => e.text).join(''), last.result.text);
  assert.deepEqual(last.result.metadata, { from: 'py' });
  assert.equal(await client.status(id), 'completed');
  assert.deepEqual(await client.result(id), last.result);
  const rest = [];
  for await (const ev of client.job(id).stream({ after: events[1].event_id })) rest.push(ev);
  assert.deepEqual(rest, events.slice(2));
  // The Python client reads the same result.
  const theirs = py(queue, `print(c.job(${JSON.stringify(id)}).result(timeout=10).model_dump_json())`);
  assert.deepEqual(theirs, last.result);
});

test('the same id is a duplicate across clients; cancel works across clients', LIMIT, async () => {
  const id = `x-${newId()}`;
  await idle.submit({ id, prompt: 'queued from js' });
  const dup = py(idleQueue, `
from producer import DuplicateJobError
try:
    c.submit(id=${JSON.stringify(id)}, prompt="again from python")
    print(json.dumps("submitted"))
except DuplicateJobError as e:
    print(json.dumps(e.ids))`);
  assert.deepEqual(dup, [id]);

  // Python cancels the JavaScript job; JavaScript sees it cancelled.
  assert.equal(py(idleQueue, `print(json.dumps(c.cancel(${JSON.stringify(id)})))`), 'cancelled');
  assert.equal(await idle.status(id), 'cancelled');
  assert.equal((await idle.result(id)).finish_reason, 'cancelled');

  // JavaScript cancels a Python job; Python reads the result the JavaScript client wrote.
  const { id: pyId } = py(idleQueue, `print(json.dumps({"id": c.submit(prompt="queued from python").id}))`);
  assert.equal(await idle.cancel(pyId), 'cancelled');
  const theirs = py(idleQueue, `
res = c.result(${JSON.stringify(pyId)}, timeout=10)
print(json.dumps({"status": c.status(${JSON.stringify(pyId)}), "result": json.loads(res.model_dump_json()),
                  "events": [e.type for e in c.stream(${JSON.stringify(pyId)})]}))`);
  assert.equal(theirs.status, 'cancelled');
  assert.equal(theirs.result.status, 'cancelled');
  assert.equal(theirs.result.finish_reason, 'cancelled');
  assert.deepEqual(theirs.events, ['cancelled']);
});

test('jobs submitted from JavaScript on a lane and a group are run by the Python worker', LIMIT, async () => {
  // The worker's intake reads every lane's stream and every group's stream (through the lane's groups set that
  // submit.lua registers the group in): one it did not find would end in a TimeoutError here.
  const grouped = await client.submit({ id: `js-${newId()}`, prompt: 'Hello', max_tokens: 4, lane: 'batch',
    group: 'acme', metadata: { from: 'js' } });
  const urgent = await client.submit({ prompt: 'Hi', max_tokens: 3, lane: 'interactive' });
  const [mine, fast] = await Promise.all([grouped, urgent].map((j) => j.result({ timeoutMs: 120_000 })));
  assert.equal(mine.status, 'completed');
  assert.equal(mine.token_ids.length, 4);
  assert.equal(fast.status, 'completed');
  assert.equal(fast.token_ids.length, 3);
  const theirs = py(queue, `
res = c.job(${JSON.stringify(grouped.id)}).result(timeout=10)
print(json.dumps({"status": c.status(${JSON.stringify(grouped.id)}), "result": json.loads(res.model_dump_json())}))`);
  assert.equal(theirs.status, 'completed');
  assert.deepEqual(theirs.result, mine);
  assert.deepEqual(theirs.result.metadata, { from: 'js' });
});
