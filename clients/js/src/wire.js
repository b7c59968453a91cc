// Names of the wire protocol that this client uses. The source of truth is producer/wire.py (job states, the
// fields of stream entries, event types, the first word of the scripts' error replies); PROTOCOL.md documents
// them. test/unit.test.js compares these with the Python ones.

// Job states (the `state` field of the job hash).
export const STATES = ['queued', 'running', 'completed', 'failed', 'cancelled', 'expired'];
export const TERMINAL_STATES = ['completed', 'failed', 'cancelled', 'expired'];

// Fields of a jobs-stream entry.
export const ENTRY_ID = 'id'; // the job id
export const ENTRY_JOB = 'job'; // the JobRequest as JSON

// The event stream pq:{q}:events:<id>: a field holding the event's JSON; a token event's entry also holds its
// offset (the job's output tokens before it), by which a reader skips chunks a failover made the worker write again.
export const EVENT_FIELD = 'e';
export const OFFSET_FIELD = 'o';
export const EV_TOKEN = 'token';
// The terminal event type of each final state.
export const TERMINAL_EVENT = { completed: 'done', failed: 'error', cancelled: 'cancelled', expired: 'error' };

// The first word of the error replies of the scripts this client calls.
export const ERR_DUPLICATE = 'DUPLICATE'; // submit: the job id exists
export const ERR_NOT_FOUND = 'NOT_FOUND'; // cancel: no such job
