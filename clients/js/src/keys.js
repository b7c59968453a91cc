// Every Redis key name of a queue. The source of truth is producer/keys.py; this module mirrors it and must
// change with it (test/unit.test.js compares the two).
//
// All keys of one queue carry the hash tag `{<queue>}`, so a script that touches several of them stays on one
// Redis Cluster slot.

export const PREFIX = 'pq';
// The one consumer group of every queue's job stream: workers of a queue share its entries.
export const GROUP = 'workers';
const QUEUE_RE = /^[A-Za-z0-9_.:-]{1,128}$/;

// A queue's priority lanes, most urgent first: each is a stream of its own, and every worker's intake reads them
// in this order (with a floor share for the lower ones). "default" is the stream `pq:{q}:jobs` that queues had
// before lanes, so jobs of older producers keep landing there.
export const LANES = Object.freeze(['interactive', 'default', 'batch']);
export const DEFAULT_LANE = 'default';
// A job's fair-share group (a tenant, a customer) becomes part of a key name: no braces (the hash tag), no
// spaces. Python's spelling of the pattern, compared by test/unit.test.js.
export const GROUP_NAME_PATTERN = '^[A-Za-z0-9_.:@\\-]{1,128}$';
export const GROUP_NAME_RE = new RegExp(GROUP_NAME_PATTERN);

/** Returns `queue`, or throws when it is not 1-128 characters of [A-Za-z0-9_.:-]. */
export function checkQueue(queue) {
  // Braces would break the hash tag; whitespace and odd characters only make keys hard to type.
  if (typeof queue !== 'string' || !QUEUE_RE.test(queue)) {
    throw new TypeError(`queue name must be 1-128 characters of [A-Za-z0-9_.:-], got ${JSON.stringify(queue)}`);
  }
  return queue;
}

/** Returns `lane`, or throws when it is not one of LANES. */
export function checkLane(lane) {
  if (!LANES.includes(lane)) {
    throw new TypeError(`lane must be one of ${LANES.join(', ')}, got ${JSON.stringify(lane)}`);
  }
  return lane;
}

/** Returns `group`, or throws when it is not 1-128 characters of [A-Za-z0-9_.:@-]. */
export function checkGroup(group) {
  if (typeof group !== 'string' || !GROUP_NAME_RE.test(group)) {
    throw new TypeError(`group must be 1-128 characters of [A-Za-z0-9_.:@-], got ${JSON.stringify(group)}`);
  }
  return group;
}

/** The key names of one queue. */
export class Keys {
  constructor(queue) {
    this.queue = checkQueue(queue);
    this.base = `${PREFIX}:{${queue}}`;
    // Stream: one entry per queued job of the default lane without a group, read by the worker group. Every
    // lane and group has a stream of its own (stream()).
    this.jobs = `${this.base}:jobs`;
    this.dlq = `${this.base}:dlq`; // stream: jobs given up on (dead letters)
    this.group = GROUP;
    // Hash: fair-share group -> its settings as JSON ({"weight": w, "max_running": n}), set by `pagedq groups`
    // and read by every worker's intake; a group without an entry has weight 1 and no cap.
    this.groups = `${this.base}:groups`;
    // Stream, capped: one entry per job queued to a group's stream, so that an idle worker blocked on it wakes
    // (group streams come and go; the lanes' own streams wake it themselves).
    this.bell = `${this.base}:bell`;
  }

  /**
   * Stream: the queued jobs of one lane and fair-share group (null or undefined: none). The default lane
   * without a group is `jobs`. Throws on an unknown lane or a bad group name.
   */
  stream(lane = DEFAULT_LANE, group = null) {
    if (group !== null && group !== undefined) return `${this.jobs}:${checkLane(lane)}:${checkGroup(group)}`;
    return checkLane(lane) === DEFAULT_LANE ? this.jobs : `${this.jobs}:${lane}`;
  }

  /** The lanes' own streams (jobs without a group), most urgent first. */
  laneStreams() {
    return LANES.map((lane) => this.stream(lane));
  }

  /** Set: the groups that have a stream in the lane (it holds jobs queued or running). */
  laneGroups(lane) {
    return `${this.base}:lane:${checkLane(lane)}:groups`;
  }

  /** Set: the groups of the lane whose streams may hold jobs no worker has read yet (submit.lua adds one). */
  ready(lane) {
    return `${this.base}:lane:${checkLane(lane)}:ready`;
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
