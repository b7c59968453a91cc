// The client a Node web app uses to enqueue jobs and read their tokens and results: the JavaScript twin of
// producer/client.py, on the npm `redis` package (node-redis), running the same Lua scripts.

import { createClient } from 'redis';
import { DuplicateJobError, JobNotFound, TimeoutError } from './errors.js';
import { Keys } from './keys.js';
import { DEFAULT_LIMITS, encodeRequest, makeRequest } from './request.js';
import { DEFAULT_GRACE_MS, Ride, addressOf, checkedGrace, isOutage, reconnectStrategy, waitReady, watch,
} from './ride.js';
import { evalMany, evalScript, script } from './scripts.js';
import { connectSentinel, isSentinelUrl, redact } from './sentinel.js';
import { ERR_DUPLICATE, ERR_NOT_FOUND, EVENT_FIELD, EV_TOKEN, OFFSET_FIELD, TERMINAL_EVENT } from './wire.js';

export const DEFAULT_URL = 'redis://localhost:6379/0';
export const DEFAULT_TTL = 24 * 3600;
// Longest single XREAD BLOCK: a wait loops, re-checking its deadline (as the Python client does).
export const BLOCK_CHUNK_MS = 2000;
// Idle blocking connections kept for the next result() / stream().
const MAX_IDLE_BLOCKING = 8;

/** A JobResult (producer/protocol.py) with every field present, defaults filled in. */
export function normalizeResult(r) {
  return {
    id: r.id,
    status: r.status,
    text: r.text ?? '',
    token_ids: r.token_ids ?? [],
    finish_reason: r.finish_reason ?? null,
    usage: { prompt_tokens: 0, completion_tokens: 0, cached_tokens: 0, ...r.usage },
    timings: { enqueued_at: null, started_at: null, first_token_at: null, finished_at: null, ...r.timings },
    worker: r.worker ?? null,
    attempts: r.attempts ?? 0,
    error: r.error ?? null,
    model: r.model ?? null,
    logprobs: r.logprobs ?? null,
    metadata: r.metadata ?? {},
    choices: r.choices ?? null,
  };
}

function parseResult(raw) {
  return normalizeResult(JSON.parse(String(raw)));
}

/** One event stream entry -> StreamEvent (producer/protocol.py) plus `event_id`, its stream entry id. */
export function parseEvent(entryId, fields) {
  let raw;
  let offset = null;
  for (let i = 0; i < fields.length; i += 2) {
    const name = String(fields[i]);
    if (name === EVENT_FIELD) raw = fields[i + 1];
    else if (name === OFFSET_FIELD) offset = Number(fields[i + 1]);
  }
  if (raw === undefined) throw new Error(`event ${entryId} has no "${EVENT_FIELD}" field`);
  const e = JSON.parse(String(raw));
  return {
    type: e.type,
    text: e.text ?? '',
    token_ids: e.token_ids ?? [],
    logprobs: e.logprobs ?? null,
    index: e.index ?? 0,
    finish_reason: e.finish_reason ?? null,
    result: e.result ? normalizeResult(e.result) : null,
    event_id: String(entryId),
    offset,
  };
}

/**
 * A live reader's memory of the tokens it has had, by offset: a failover to a replica that lacked a job's last
 * chunks makes the worker write them again, under entry ids after those the reader saw on the old primary;
 * without this the reader would yield those tokens twice. (Entries without an offset pass: older workers.)
 */
export class Repeats {
  constructor() {
    this.next = 0; // the offset of the first token not yet had
  }

  fresh(ev) {
    if (ev.offset === null || ev.offset === undefined || ev.type !== EV_TOKEN) return true;
    if (ev.offset < this.next) return false;
    this.next = ev.offset + ev.token_ids.length;
    return true;
  }
}

function isTerminal(ev) {
  return ev.type !== EV_TOKEN;
}

// A terminal event rebuilt from a stored result, for a reader that comes after the events expired.
function resultEvent(raw) {
  const result = parseResult(raw);
  return { type: TERMINAL_EVENT[result.status] ?? 'error', text: '', token_ids: [], logprobs: null, index: 0,
    finish_reason: null, result, event_id: null, offset: null };
}

// The entries of an XREAD reply on one stream, as [id, fields] pairs: RESP2 gives [[name, entries]], RESP3 a
// map (a Map or a plain object, by the client's type mapping).
function xreadEntries(reply) {
  if (!reply) return [];
  if (Array.isArray(reply)) return reply.length ? reply[0][1] : [];
  if (reply instanceof Map) return [...reply.values()][0] ?? [];
  return Object.values(reply)[0] ?? [];
}

// Stream ids "ms-seq": compare as two integers.
function compareIds(a, b) {
  const [am, as] = a.split('-').map(BigInt);
  const [bm, bs] = b.split('-').map(BigInt);
  return am === bm ? (as === bs ? 0 : as < bs ? -1 : 1) : am < bm ? -1 : 1;
}

class Deadline {
  constructor(timeoutMs) {
    this.end = timeoutMs == null ? null : Date.now() + timeoutMs;
  }

  /** How long the next XREAD may block: at least 1 ms (0 would mean forever). */
  blockMs() {
    if (this.end === null) return BLOCK_CHUNK_MS;
    return Math.max(1, Math.min(BLOCK_CHUNK_MS, this.end - Date.now()));
  }

  expired() {
    return this.end !== null && Date.now() >= this.end;
  }
}

function notFound(jobId) {
  return new JobNotFound(`no job ${JSON.stringify(jobId)} (never submitted, or its keys expired)`, jobId);
}

function checkJobId(jobId) {
  if (typeof jobId !== 'string' || !jobId) throw new TypeError(`job id must be a non-empty string, got ${jobId}`);
  return jobId;
}

/**
 * `new Client({url, queue, resultTtl, limits, redis, graceMs})`. url: $REDIS_URL, else redis://localhost:6379/0;
 * `redis+sentinel://host1:26379,host2:26379/<service>[/<db>]` finds the primary through Sentinel.
 * graceMs: how long each Redis operation of a call rides through an outage (a restart, a failover) before
 * RedisUnavailable; 0: fail at once.
 * Connects on first use (or `await client.connect()`); `await client.close()` when done.
 */
export class Client {
  constructor({ url, queue = 'default', resultTtl = DEFAULT_TTL, limits, redis, onError,
    graceMs = DEFAULT_GRACE_MS } = {}) {
    this.keys = new Keys(queue);
    this.queue = queue;
    if (!Number.isSafeInteger(resultTtl) || resultTtl < 1) {
      throw new TypeError(`resultTtl must be a positive integer (seconds), got ${resultTtl}`);
    }
    this.resultTtl = resultTtl;
    this.limits = { ...DEFAULT_LIMITS, ...limits };
    this.onError = onError ?? (() => {});
    this.graceMs = checkedGrace(graceMs);
    this.ownsRedis = !redis;
    this.url = redis ? undefined : url || process.env.REDIS_URL || DEFAULT_URL;
    const sentinel = !redis && isSentinelUrl(this.url);
    this.where = redis ? addressOf(redis) : redact(this.url);
    // node-redis emits "error" on every failed (re)connect; an EventEmitter without a listener would crash the
    // app. watch() also keeps the last one, which a call waiting for the connection reports.
    // A redis+sentinel:// URL finds the primary through Sentinel and follows it after a failover (sentinel.js).
    // disableOfflineQueue: a command sent while the connection is down fails at once and our Ride sends it again
    // with backoff, so that the grace bounds the wait. node-redis's offline queue would hold it without a limit,
    // and might still send a submit after the call had given up and said so.
    const node = { disableOfflineQueue: true, socket: { reconnectStrategy } };
    const made = redis ? null : sentinel ? connectSentinel(this.url, node) : createClient({ url: this.url, ...node });
    this.redis = watch(redis ?? made, (e) => this.onError(e));
    this.sentinel = sentinel;
    this._idle = []; // blocking connections ready for reuse
    this._busy = new Set(); // blocking connections in an XREAD now
    this._closed = false;
  }

  /** Connects the main connection (done on first use anyway), riding through an outage for the grace. */
  async connect() {
    const ride = this._ride();
    await ride.run(() => this._ready(ride));
    return this;
  }

  // A Ride for one call (its deadline: the call's timeout's end, ms since the epoch).
  _ride(options) {
    return new Ride(this.graceMs, this.where, { ...options, bounded: this.sentinel });
  }

  // The main connection once it is ready: (re)connects it where it is closed (node-redis leaves a client closed
  // after a refusal), waits for it where it is (re)connecting. An outage error when it does not come up.
  async _ready(ride) {
    if (this._closed) throw new Error('pagedq client is closed');
    const r = this.redis;
    if (r.isReady) return r;
    if (!r.isOpen) r.connect().catch(() => {}); // its errors reach the 'error' listener, which waitReady reads
    await waitReady(r, ride.waitMs());
    return r;
  }

  // One command on the main connection, sent again through an outage.
  _send(ride, args) {
    return ride.run(async () => (await this._ready(ride)).sendCommand(args));
  }

  // XREAD BLOCK holds its connection for the whole wait, so each waiting result()/stream() gets one of its own
  // (a duplicate of the main one), or every other command of the app would queue behind it.
  async _acquireBlocking(ride) {
    if (this._closed) throw new Error('pagedq client is closed');
    let c;
    while ((c = this._idle.pop()) && !c.isReady) destroy(c); // an idle one may have lost its server meanwhile
    if (!c) {
      c = watch(this.redis.duplicate(), (e) => this.onError(e));
      c.connect().catch(() => {});
      try {
        await waitReady(c, ride.waitMs());
      } catch (err) {
        destroy(c); // else it would go on reconnecting by itself
        throw err;
      }
    }
    this._busy.add(c);
    return c;
  }

  _releaseBlocking(c, reusable) {
    this._busy.delete(c);
    if (reusable && !this._closed && c.isReady && this._idle.length < MAX_IDLE_BLOCKING) this._idle.push(c);
    else destroy(c);
  }

  // One XREAD BLOCK on a job's events after `last`; an abort (signal) closes its connection to stop the wait.
  async _xread(ride, key, last, blockMs, signal) {
    signal?.throwIfAborted();
    const c = await this._acquireBlocking(ride);
    if (signal?.aborted) {
      this._releaseBlocking(c, true);
      signal.throwIfAborted();
    }
    let ok = false;
    const onAbort = () => destroy(c);
    signal?.addEventListener('abort', onAbort, { once: true });
    try {
      const reply = await c.sendCommand(['XREAD', 'COUNT', '1000', 'BLOCK', String(blockMs), 'STREAMS', key, last]);
      ok = true;
      return xreadEntries(reply).map(([id, fields]) => parseEvent(id, fields));
    } catch (err) {
      signal?.throwIfAborted();
      throw err;
    } finally {
      signal?.removeEventListener('abort', onAbort);
      this._releaseBlocking(c, ok && !signal?.aborted);
    }
  }

  /**
   * Enqueues one job. `request`: JobRequest fields (snake_case, as in producer/protocol.py): prompt or
   * messages, max_tokens, temperature, ..., `lane` and `group` (the stream it is queued on). An id is made when
   * none is given. Throws InvalidRequestError for a bad request, DuplicateJobError when a job with this id
   * exists.
   */
  async submit(request) {
    const req = makeRequest(request, this.limits);
    const call = this._submitCall(req);
    const ride = this._ride();
    try {
      await ride.run(async () => evalScript(await this._ready(ride), script('submit'), ...call));
    } catch (err) {
      // A retried submit that finds its own job (the first try's reply was lost to the outage) has succeeded:
      // the job id is the idempotency key.
      if (!isDuplicate(err)) throw err;
      if (!ride.retried || !(await this._isOwn(ride, call))) {
        throw new DuplicateJobError(`job id already exists: ${req.id}`, [req.id], []);
      }
    }
    return new Job(this, req.id);
  }

  /**
   * Enqueues many jobs in one pipelined round trip. Duplicates are refused one by one: every other job is
   * submitted, then DuplicateJobError lists the refused ids (and carries the submitted jobs in `jobs`).
   * Every request is validated before any is sent. Through an outage the whole round trip is sent again; a job
   * it finds already stored by its own first try counts as submitted.
   */
  async submitMany(requests) {
    const reqs = [...requests].map((r) => makeRequest(r, this.limits));
    if (!reqs.length) return [];
    const calls = reqs.map((r) => this._submitCall(r));
    const ride = this._ride();
    const replies = await ride.run(async () => {
      const out = await evalMany(await this._ready(ride), script('submit'), calls);
      const down = out.find((r) => r.status === 'rejected' && isOutage(r.reason));
      if (down) throw down.reason; // part of the round trip may have landed: the retry's own-job check sees to it
      return out;
    });
    const jobs = [];
    const dups = [];
    for (const [i, req] of reqs.entries()) {
      const r = replies[i];
      if (r.status === 'fulfilled') jobs.push(new Job(this, req.id));
      else if (!isDuplicate(r.reason)) throw r.reason;
      else if (ride.retried && await this._isOwn(ride, calls[i])) jobs.push(new Job(this, req.id));
      else dups.push(req.id);
    }
    if (dups.length) throw new DuplicateJobError(`job id already exists: ${dups.join(', ')}`, dups, jobs);
    return jobs;
  }

  // Whether the job a submit call names is the one this very call stored (its reply was lost to an outage): the
  // stored enqueued_at is the call's own, or the queued payload is the same (producer/flows.py is_own).
  async _isOwn(ride, [keys, args]) {
    const job = keys[0];
    const [payload, enqueuedAt] = [args[1], args[2]];
    const [at, entry, stored] = await this._send(ride, ['HMGET', job, 'enqueued_at', 'entry', 'stream']);
    if (at !== null && String(at) === enqueuedAt) return true;
    if (!entry || !stored) return false; // taken off its stream already: only enqueued_at could have told
    const found = await this._send(ride, ['XRANGE', String(stored), String(entry), String(entry)]);
    if (!found.length) return false;
    const fields = found[0][1];
    for (let i = 0; i < fields.length; i += 2) {
      if (String(fields[i]) === 'job') return String(fields[i + 1]) === payload;
    }
    return false;
  }

  _submitCall(req) {
    // submit.lua (producer/calls.py `submit` and `lane_keys`): KEYS job hash, result key, the job's stream (its
    // lane's, or its group's within the lane), the lane's groups and ready sets, the bell; ARGV job id,
    // JobRequest JSON, enqueued_at (unix seconds), the group ("": none). The sets and the bell are touched only
    // for a group's stream, so that the workers' intake finds a group that had no jobs.
    const k = this.keys;
    return [[k.job(req.id), k.result(req.id), k.stream(req.lane, req.group), k.laneGroups(req.lane), k.ready(req.lane),
      k.bell], [req.id, encodeRequest(req), String(Date.now() / 1000), req.group ?? '']];
  }

  /** A handle on a job by id (no Redis call). */
  job(jobId) {
    return new Job(this, checkJobId(jobId));
  }

  /** The job's state: queued | running | completed | failed | cancelled | expired. Throws JobNotFound. */
  async status(jobId) {
    checkJobId(jobId);
    const ride = this._ride();
    const [state, raw] = await ride.run(async () => {
      const redis = await this._ready(ride);
      return Promise.all([
        redis.sendCommand(['HGET', this.keys.job(jobId), 'state']),
        redis.sendCommand(['GET', this.keys.result(jobId)]),
      ]);
    });
    if (state) return String(state);
    if (raw) return parseResult(raw).status;
    throw notFound(jobId);
  }

  /**
   * Waits for the job's result (a JobResult): reads its result key, else blocks on its event stream (XREAD
   * BLOCK on a connection of its own; no polling) until the terminal event. Throws TimeoutError after
   * `timeoutMs` (default: wait for ever), JobNotFound for an unknown id; `signal` (AbortSignal) stops the wait.
   * Through a Redis outage it keeps waiting (within timeoutMs) and resumes after the last event it read.
   */
  async result(jobId, { timeoutMs, signal } = {}) {
    checkJobId(jobId);
    signal?.throwIfAborted();
    const deadline = new Deadline(timeoutMs);
    const ride = this._ride({ deadline: deadline.end, jobId, signal });
    const k = this.keys;
    const raw = await this._send(ride, ['GET', k.result(jobId)]);
    if (raw) return parseResult(raw);
    let last = '0-0';
    const tail = await this._send(ride, ['XREVRANGE', k.events(jobId), '+', '-', 'COUNT', '1']);
    if (tail.length) {
      const ev = parseEvent(...tail[0]);
      if (isTerminal(ev)) return ev.result;
      last = ev.event_id;
    } else if (!(await this._send(ride, ['EXISTS', k.job(jobId)]))) {
      throw notFound(jobId);
    }
    for (;;) {
      const events = await ride.run(() => this._xread(ride, k.events(jobId), last, deadline.blockMs(), signal));
      for (const ev of events) {
        last = ev.event_id;
        if (isTerminal(ev)) return ev.result;
      }
      if (deadline.expired()) throw new TimeoutError(`job ${jobId} has no result after ${timeoutMs} ms`, jobId);
    }
  }

  /**
   * The job's events as an async iterator: token events ({type: "token", text, token_ids}), then exactly one
   * terminal event ("done", "error" or "cancelled") whose `result` is the JobResult. Each event's `event_id` is
   * its stream entry id: pass it as `after` to resume after it (SSE's Last-Event-ID). A stream resumed after
   * its terminal event ends at once. Throws TimeoutError after `timeoutMs` (default: wait for ever),
   * JobNotFound for an unknown id; `signal` (AbortSignal) stops it. A job with several continuations (n > 1)
   * interleaves their token events, each event's `index` saying which; `choice` keeps one's. Through a Redis
   * outage it keeps waiting (within timeoutMs) and resumes after the last event it yielded: none lost or repeated.
   */
  async* stream(jobId, { after = '0-0', timeoutMs, signal, choice } = {}) {
    for await (const ev of this._events(jobId, { after, timeoutMs, signal })) {
      if (choice === undefined || choice === null || isTerminal(ev) || ev.index === choice) yield ev;
    }
  }

  async* _events(jobId, { after, timeoutMs, signal }) {
    checkJobId(jobId);
    if (typeof after !== 'string' || !/^\d+(-\d+)?$/.test(after)) {
      throw new TypeError(`after must be a stream entry id like "1700000000000-0", got ${JSON.stringify(after)}`);
    }
    signal?.throwIfAborted();
    const deadline = new Deadline(timeoutMs);
    const ride = this._ride({ deadline: deadline.end, jobId, signal });
    const k = this.keys;
    const tail = await this._send(ride, ['XREVRANGE', k.events(jobId), '+', '-', 'COUNT', '1']);
    if (!tail.length) {
      // No events (yet, or any more): a finished job whose events expired still has its result.
      const raw = await this._send(ride, ['GET', k.result(jobId)]);
      if (raw) {
        yield resultEvent(raw);
        return;
      }
      if (!(await this._send(ride, ['EXISTS', k.job(jobId)]))) throw notFound(jobId);
    } else if (after !== '0-0') {
      const ev = parseEvent(...tail[0]);
      // The reader has had the terminal event already (an EventSource reconnects after the end): nothing more.
      if (isTerminal(ev) && compareIds(ev.event_id, after.includes('-') ? after : `${after}-0`) <= 0) return;
    }
    let last = after;
    const repeats = new Repeats();
    for (;;) {
      const events = await ride.run(() => this._xread(ride, k.events(jobId), last, deadline.blockMs(), signal));
      for (const ev of events) {
        last = ev.event_id;
        if (!repeats.fresh(ev)) continue;
        yield ev;
        if (isTerminal(ev)) return;
      }
      if (deadline.expired()) throw new TimeoutError(`job ${jobId} did not finish within ${timeoutMs} ms`, jobId);
    }
  }

  /**
   * Cancels a job. Returns "cancelled" (it was queued), "cancelling" (it runs; the worker stops it at its next
   * step), or its terminal state unchanged ("completed", "failed", "cancelled", "expired"). Throws JobNotFound.
   */
  async cancel(jobId) {
    checkJobId(jobId);
    const k = this.keys;
    // cancel.lua (producer/calls.py `cancel`): ARGV[1] is the result a queued job gets. KEYS[4] is always the
    // default lane's stream: the script deletes a queued job's entry only there; one on another lane's or a
    // group's stream stays, and the worker that reads it skips it.
    const res = normalizeResult({ id: jobId, status: 'cancelled', finish_reason: 'cancelled',
      timings: { finished_at: Date.now() / 1000 } });
    const ride = this._ride();
    try {
      // Sent again through an outage: a second cancel of a job the first one cancelled answers its state.
      const reply = await ride.run(async () => evalScript(await this._ready(ride), script('cancel'),
        [k.job(jobId), k.events(jobId), k.result(jobId), k.jobs], [JSON.stringify(res), this.resultTtl]));
      return String(reply);
    } catch (err) {
      if (errorCode(err) === ERR_NOT_FOUND) throw notFound(jobId);
      throw err;
    }
  }

  /** Closes every connection: the main one (unless it was passed in as `redis`) and the blocking ones. */
  async close() {
    this._closed = true;
    for (const c of [...this._idle, ...this._busy]) destroy(c);
    this._idle = [];
    this._busy.clear();
    if (this.ownsRedis && this.redis.isOpen) {
      // One that is down and reconnecting has nothing to finish: destroy stops its reconnecting at once.
      if (!this.redis.isReady) destroy(this.redis);
      else await (typeof this.redis.close === 'function' ? this.redis.close() : this.redis.quit());
    }
  }
}

// The first word of a script's error reply ("DUPLICATE job ... exists").
function errorCode(err) {
  return String(err?.message ?? '').split(' ', 1)[0];
}

// `await using client = new Client(...)` where the runtime has explicit resource management (Node 18.18+, 20.4+).
if (Symbol.asyncDispose) {
  Client.prototype[Symbol.asyncDispose] = function asyncDispose() {
    return this.close();
  };
}

function isDuplicate(err) {
  return errorCode(err) === ERR_DUPLICATE;
}

function destroy(c) {
  if (!c.isOpen) return;
  try {
    if (typeof c.destroy === 'function') c.destroy();
    else c.disconnect();
  } catch {
    // closed already
  }
}

/** A handle on one submitted job. */
export class Job {
  constructor(client, jobId) {
    this.client = client;
    this.id = jobId;
  }

  status() {
    return this.client.status(this.id);
  }

  result(options) {
    return this.client.result(this.id, options);
  }

  stream(options) {
    return this.client.stream(this.id, options);
  }

  cancel() {
    return this.client.cancel(this.id);
  }

  toJSON() {
    return { id: this.id };
  }
}
