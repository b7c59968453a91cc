// Every Redis key name of a queue. The source of truth is producer/keys.py; this module mirrors it and must
// change with it (test/unit.test.js compares the two).
//
// All keys of one queue carry the hash tag `{<queue>}`, so a script that touches several of them stays on one
// Redis Cluster slot.

export const PREFIX = 'pq';
// The one consumer group of every queue's job stream: workers of a queue share its entries.
export const GROUP = 'workers';
const QUEUE_RE = /^[A-Za-z0-9_.:-]{1,128}$/;

/** Returns `queue`, or throws when it is not 1-128 characters of [A-Za-z0-9_.:-]. */
export function checkQueue(queue) {
  // Braces would break the hash tag; whitespace and odd characters only make keys hard to type.
  if (typeof queue !== 'string' || !QUEUE_RE.test(queue)) {
    throw new TypeError(`queue name must be 1-128 characters of [A-Za-z0-9_.:-], got ${JSON.stringify(queue)}`);
  }
  return queue;
}

/** The key names of one queue. */
export class Keys {
  constructor(queue) {
    this.queue = checkQueue(queue);
    this.base = `${PREFIX}:{${queue}}`;
    this.jobs = `${this.base}:jobs`; // stream: one entry per queued job, read by the worker group
    this.dlq = `${this.base}:dlq`; // stream: jobs given up on (dead letters)
    this.group = GROUP;
  }

  /** Hash: the job's state, lease token, attempts, timestamps. */
  job(jobId) {
    return `${this.base}:job:${jobId}`;
  }

  /** Stream: the job's token chunks, then one terminal event. */
  events(jobId) {
    return `${this.base}:events:${jobId}`;
  }

  /** String: the job's final JobResult as JSON, with a TTL. */
  result(jobId) {
    return `${this.base}:result:${jobId}`;
  }
}
