// Riding through a Redis outage: a restart, a Sentinel failover, a dropped connection (producer/ride.py's twin,
// with the same numbers).
//
// A Ride wraps each Redis operation of one client call. An operation that fails for want of Redis is sent again,
// with backoff (50 ms doubling to 1 s, jittered), until it gets through or the outage has lasted the grace; then
// RedisUnavailable names the address and how long it waited. Re-sending the very same operation is what makes this
// safe and lossless: a call's state (the last event id a reader saw, the enqueued_at a submit carries) lives in the
// call, so an XREAD resumes after the last event it yielded and a retried submit can recognise its own job.

import { setTimeout as sleep } from 'node:timers/promises';
import { RedisUnavailable, TimeoutError } from './errors.js';

export const DEFAULT_GRACE_MS = 30_000;
export const FIRST_DELAY_MS = 50;
export const MAX_DELAY_MS = 1000;
// The longest one wait for a connection to come up, when nothing (an error, the call's deadline) ends it first.
export const CONNECT_WAIT_MS = 5000;
// A bounded ride (see Ride's `bounded`) lets one try run at least this long: an XREAD BLOCK of up to 2 s is no hang.
const MIN_TRY_MS = 3000;

// Socket errors of a server that is away for now (Node's error codes).
const NET_CODES = new Set(['ECONNREFUSED', 'ECONNRESET', 'ECONNABORTED', 'EPIPE', 'ETIMEDOUT', 'EHOSTUNREACH',
  'EHOSTDOWN', 'ENETUNREACH', 'ENETDOWN', 'ENOTFOUND', 'EAI_AGAIN', 'ENOTCONN', 'ERR_SOCKET_CLOSED',
  'ERR_STREAM_DESTROYED', 'ERR_STREAM_WRITE_AFTER_END']);
// node-redis's errors (by class name: a client passed in may come from another copy of the package) for a
// connection that is down, reconnecting or closed; NotConnected is ours (waitReady).
const CLIENT_ERRORS = new Set(['ClientClosedError', 'ClientOfflineError', 'SocketClosedUnexpectedlyError',
  'SocketTimeoutError', 'ConnectionTimeoutError', 'NotConnected']);
// Error replies of a server that cannot serve yet: loading its data (a restart with AOF), a demoted primary still
// answering until the client follows the new one, a replica that lost its primary.
const OUTAGE_REPLIES = new Set(['LOADING', 'READONLY', 'MASTERDOWN']);
// Replies that refuse this client: waiting would only delay the answer.
const REFUSED_REPLIES = new Set(['WRONGPASS', 'NOAUTH', 'NOPERM']);
// node-redis's RedisSentinel while the Sentinels name no primary, or none of them answers.
const SENTINEL_RE = /no valid master node|none of the sentinels are available|connect to any sentinel|Master Node Not Enumerated/i;

/** A connection that did not come up in time (no error said why), or a try that got no answer. */
export class NotConnected extends Error {
  constructor(message, since = null) {
    super(message);
    this.name = 'NotConnected';
    this.since = since; // when the try that got no answer began: the outage began no later
  }
}

function isTlsError(err) {
  const code = String(err.code ?? '');
  return /CERT|SSL|TLS/.test(code) || /certificate/i.test(String(err.message ?? ''));
}

/** Whether `err` means Redis is away for now (worth waiting for), not that it refuses this client. */
export function isOutage(err, depth = 0) {
  if (!err || typeof err !== 'object' || depth > 4) return false;
  const name = err.constructor?.name;
  // Our reconnect strategy stops on a refusal, and node-redis wraps that refusal in a ReconnectStrategyError.
  if (name === 'ReconnectStrategyError') return isOutage(err.originalError, depth + 1);
  const message = String(err.message ?? '');
  const word = message.split(' ', 1)[0];
  if (REFUSED_REPLIES.has(word) || isTlsError(err)) return false;
  if (OUTAGE_REPLIES.has(word) || CLIENT_ERRORS.has(name) || NET_CODES.has(err.code) || SENTINEL_RE.test(message)) {
    return true;
  }
  return isOutage(err.cause, depth + 1); // RedisSentinel wraps a node's error: "Master Client (h:p): ..."
}

/**
 * node-redis's reconnectStrategy for the client's connections: through an outage it keeps reconnecting (node-redis's
 * default gives up on a socket timeout, leaving the client closed for good), 50 ms doubling to 1 s, jittered; a
 * refusal (a wrong password, a TLS certificate) stops it, so that the call that waits for it fails at once.
 */
export function reconnectStrategy(retries, cause) {
  if (!isOutage(cause)) return cause instanceof Error ? cause : new Error(String(cause));
  return jitter(Math.min(FIRST_DELAY_MS * 2 ** Math.min(retries, 10), MAX_DELAY_MS));
}

// Many clients that lost the same server should not all come back in the same millisecond.
function jitter(ms) {
  return Math.round(ms * (0.5 + Math.random() / 2));
}

/** A grace option, refused with a clear error where it is not milliseconds >= 0. */
export function checkedGrace(graceMs) {
  if (typeof graceMs !== 'number' || !(graceMs >= 0) || !Number.isFinite(graceMs)) {
    throw new TypeError(`graceMs must be milliseconds >= 0 (0: no retries through an outage), got ${graceMs}`);
  }
  return graceMs;
}

function seconds(ms) {
  return `${Math.round(ms / 100) / 10}`;
}

/**
 * One client call's retry state. graceMs: how long an outage may last (0: fail at once); where: the address for
 * errors (no password); deadline: the call's own end (Date.now() ms; its timeout), past which it stops too;
 * jobId: named by that TimeoutError; signal: an AbortSignal that ends the pauses; bounded: a try that neither
 * answers nor fails is given up at the end of the grace (node-redis's RedisSentinel holds a command, without an
 * error, until the Sentinels name a primary).
 */
export class Ride {
  constructor(graceMs, where, { deadline = null, jobId, signal, bounded = false } = {}) {
    this.graceMs = graceMs;
    this.where = where;
    this.deadline = deadline;
    this.jobId = jobId;
    this.signal = signal;
    this.bounded = bounded;
    this.retried = false; // an operation was sent again: a write may have landed the first time
  }

  /** How long one wait for a connection may last: up to the call's deadline, at most CONNECT_WAIT_MS. */
  waitMs() {
    if (this.deadline === null) return CONNECT_WAIT_MS;
    return Math.max(1, Math.min(CONNECT_WAIT_MS, this.deadline - Date.now()));
  }

  /** await fn(), sent again through an outage. */
  async run(fn) {
    let since = null;
    for (let delay = FIRST_DELAY_MS; ; delay = Math.min(delay * 2, MAX_DELAY_MS)) {
      try {
        return await (this.bounded ? this._bound(fn(), since) : fn());
      } catch (err) {
        this.signal?.throwIfAborted();
        if (!isOutage(err)) throw err;
        since ??= err.since ?? Date.now();
        const pause = this._pause(err, since, delay);
        try {
          await sleep(pause, undefined, { signal: this.signal });
        } catch {
          this.signal.throwIfAborted();
        }
      }
    }
  }

  // `promise`, or NotConnected once the grace (or the call's deadline) is over with no answer. The try itself
  // goes on: a command that was queued may still run later (a submit then finds its job stored when retried).
  async _bound(promise, since) {
    const start = Date.now();
    const end = Math.min((since ?? start) + this.graceMs, this.deadline ?? Infinity);
    const ms = Math.max(MIN_TRY_MS, end - start);
    let timer;
    const late = new Promise((_, reject) => {
      timer = setTimeout(() => reject(new NotConnected(`no answer in ${seconds(ms)} s`, start)), ms);
    });
    promise.catch(() => {}); // given up on: its late failure is nobody's
    try {
      return await Promise.race([promise, late]);
    } finally {
      clearTimeout(timer);
    }
  }

  // How long to sleep before the next try; throws once the grace (or the call's deadline) is spent.
  _pause(err, since, delay) {
    const now = Date.now();
    const waited = now - since;
    const last = err?.message || String(err);
    if (waited >= this.graceMs) {
      throw new RedisUnavailable(`Redis at ${this.where} unreachable for ${seconds(waited)} s (the client's grace `
        + `is ${seconds(this.graceMs)} s): ${last}`, waited / 1000, { cause: err });
    }
    if (this.deadline !== null && now >= this.deadline) {
      throw new TimeoutError(`timed out while Redis at ${this.where} was unreachable (${seconds(waited)} s so far): `
        + `${last}`, this.jobId);
    }
    this.retried = true;
    const end = Math.min(since + this.graceMs, this.deadline ?? Infinity);
    return Math.max(0, Math.min(jitter(delay), end - now));
  }
}

// Each connection's errors, as its 'error' listener (watch) records them.
const seen = new WeakMap();

/** Records `c`'s errors for waitReady; `onError` is called with each too. Returns c. */
export function watch(c, onError = () => {}) {
  const s = { errors: 0, last: null };
  seen.set(c, s);
  return c.on('error', (e) => {
    s.errors++;
    s.last = e;
    onError(e);
  });
}

/**
 * Waits until `c` (watched) is ready: throws the next error it reports (its connect or reconnect failed), or
 * NotConnected after `ms`. Polls: node-redis and RedisSentinel both have isReady, not both a 'ready' event.
 */
export async function waitReady(c, ms) {
  const s = seen.get(c) ?? { errors: 0, last: null };
  const from = s.errors;
  const end = Date.now() + ms;
  for (let pause = 2; !c.isReady; pause = Math.min(pause * 2, 50)) {
    if (s.errors !== from) throw s.last;
    if (Date.now() >= end) {
      throw new NotConnected(`not connected after ${ms} ms${s.last ? ` (last error: ${s.last.message})` : ''}`);
    }
    await sleep(pause);
  }
}

/** Where a client passed in connects, for errors (no password): host:port, else what it is. */
export function addressOf(redis) {
  const socket = redis?.options?.socket;
  if (socket?.path) return `unix:${socket.path}`;
  if (socket?.host || socket?.port) return `${socket.host ?? 'localhost'}:${socket.port ?? 6379}`;
  return 'the given Redis client';
}
