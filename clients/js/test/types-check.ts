// Compiled (not run) by test/types.test.js: `tsc -p tsconfig.json` checks index.d.ts against real use.
import {
  Client, DEFAULT_GRACE_MS, DEFAULT_LANE, DuplicateJobError, InvalidRequestError, LANES, RedisUnavailable, checkGroup,
  checkLane, createClient, makeRequest, type JobResult, type Lane, type StreamEvent,
} from 'pagedq';
import { createClient as createRedis } from 'redis';

export async function use(): Promise<string> {
  const client = new Client({ url: 'redis://localhost:6379/0', queue: 'default', resultTtl: 3600 });
  const other = createClient({ redis: createRedis(), limits: { max_tokens: 1024 }, graceMs: DEFAULT_GRACE_MS / 2 });
  const job = await client.submit({ messages: [{ role: 'user', content: 'hi' }], max_tokens: 16, stop: '\n' });
  const res: JobResult = await job.result({ timeoutMs: 60_000 });
  let text = '';
  for await (const ev of client.stream(job.id, { after: '0-0', signal: AbortSignal.timeout(1000) })) {
    const e: StreamEvent = ev;
    if (e.type === 'token') text += e.text;
    else if (e.result.error) text += e.result.error.type;
  }
  const many = await client.submit({ prompt: 'p', n: 2, best_of: 3, early_stopping: 'never' });
  for await (const ev of many.stream({ choice: 1 })) {
    if (ev.type === 'token') text += `${ev.index}${ev.finish_reason ?? ''}`;
  }
  for (const c of (await many.result()).choices ?? []) text += `${c.index}${c.text}${c.cumulative_logprob ?? ''}`;
  const shaped = await client.submit({ prompt: 'p', response_format: { type: 'json_schema', json_schema: { name: 'x',
    schema: { type: 'object', properties: { n: { type: 'integer', maximum: 9 } }, required: ['n'] }, strict: true } } });
  text += (await shaped.result()).text;
  await client.submitMany([{ prompt: 'p', guided_choice: ['yes', 'no'] }, { prompt: 'p', guided_regex: '[0-9]+' },
    { prompt: 'p', guided_json: '{"type": "string"}' }, { prompt: 'p', guided_grammar: 'start: "a"+' },
    { prompt: 'p', response_format: { type: 'json_object' } }]);
  text += String(createClient({ limits: { max_constraint_bytes: 1024 } }).limits.max_constraint_bytes);
  const stops = createClient({ limits: { max_stop_chars: 64, max_stop_token_ids: 8 } }).limits;
  text += `${stops.max_stop_chars}${stops.max_stop_token_ids}`;
  try {
    await client.submitMany([{ prompt: 'a' }, { id: job.id, prompt: 'b' }]);
  } catch (err) {
    if (err instanceof DuplicateJobError) text += err.ids.join() + err.jobs.map((j) => j.id).join();
    if (err instanceof InvalidRequestError) text += err.field;
    if (err instanceof RedisUnavailable) text += `${err.waited} of ${other.graceMs}`;
  }
  const lanes: Lane[] = [...LANES, DEFAULT_LANE, checkLane('batch')];
  await client.submitMany(lanes.map((lane) => ({ prompt: 'p', lane, group: checkGroup('acme') })));
  await client.submit({ prompt: 'p', lane: 'interactive', group: null });
  const made: Lane = makeRequest({ prompt: 'p', lane: 'batch' }).lane;
  const k = client.keys;
  text += [made, k.groups, k.bell, k.stream(), k.stream('batch'), k.stream('batch', 'acme'), ...k.laneStreams(),
    k.laneGroups('interactive'), k.ready('default')].join();
  const state: 'cancelled' | 'cancelling' | 'completed' | 'failed' | 'expired' = await job.cancel();
  await other.close();
  await client.close();
  return `${res.text}${text}${state}${await client.status(job.id)}`;
}
