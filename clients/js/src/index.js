// pagedq's JavaScript client: enqueue LLM generation jobs on Redis Streams, stream their tokens, read results.
import { Client } from './client.js';

export { Client, Job, DEFAULT_TTL, DEFAULT_URL, normalizeResult, parseEvent } from './client.js';
export {
  DuplicateJobError, InvalidRequestError, JobNotFound, PagedqError, RedisUnavailable, TimeoutError,
} from './errors.js';
export { DEFAULT_GRACE_MS } from './ride.js';
export {
  Keys, checkGroup, checkLane, checkQueue, DEFAULT_LANE, GROUP, GROUP_NAME_PATTERN, LANES, PREFIX,
} from './keys.js';
export { STATES, TERMINAL_STATES, TERMINAL_EVENT } from './wire.js';
export { isSentinelUrl, parseSentinelUrl } from './sentinel.js';
export { DEFAULT_LIMITS, encodeRequest, makeRequest, newId } from './request.js';

/** `createClient(options)`: the same as `new Client(options)`. */
export function createClient(options) {
  return new Client(options);
}
