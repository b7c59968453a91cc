// Building a JobRequest the way producer/protocol.py does (JobRequest and Limits): the same fields, defaults
// and checks, so that a bad request fails here, with a clear error, instead of in the worker. The worker checks
// again (a producer may skip the client); the wire format is JobRequest JSON without the fields that hold their
// default (pydantic's `exclude_defaults`), as the Python client's submit call (producer/calls.py) sends it.

import { randomUUID } from 'node:crypto';
import { InvalidRequestError } from './errors.js';
import { DEFAULT_LANE, GROUP_NAME_RE, LANES } from './keys.js';

// Field order and defaults of producer/protocol.py JobRequest (id has a factory: always sent). The sampling
// fields' defaults and bounds (max_tokens ... early_stopping, checked in makeRequest) restate
// producer/sampling_fields.py's table: tests/queue/test_sampling_fields.py holds them to it.
const DEFAULTS = {
  id: undefined,
  model: null,
  prompt: null,
  messages: null,
  max_tokens: 256,
  temperature: 1.0,
  top_p: 1.0,
  top_k: 0,
  min_p: 0.0,
  seed: null,
  stop: [],
  stop_token_ids: [],
  ignore_eos: false,
  logprobs: null,
  presence_penalty: 0.0,
  frequency_penalty: 0.0,
  repetition_penalty: 1.0,
  n: 1,
  best_of: null,
  use_beam_search: false,
  beam_width: null,
  length_penalty: 1.0,
  early_stopping: false,
  speculative: true,
  response_format: null,
  guided_json: null,
  guided_regex: null,
  guided_choice: null,
  guided_grammar: null,
  lane: DEFAULT_LANE,
  priority: 0,
  group: null,
  timeout_s: null,
  metadata: {},
};
export const FIELDS = Object.keys(DEFAULTS);

export const DEFAULT_LIMITS = Object.freeze({
  max_prompt_chars: 1_000_000, // prompt, or all message contents together
  max_messages: 1024,
  max_tokens: 32_768,
  max_metadata_bytes: 16_384,
  max_stop: 16,
  max_stop_chars: 1_000, // each stop string: every new token's text is matched against them
  max_stop_token_ids: 256, // beam search ranks (1 + this) x beams candidates a step
  max_n: 16, // continuations returned
  max_width: 32, // continuations run at once: best_of, beam_width
  max_constraint_bytes: 65_536, // a schema, regex, grammar or the choices, as compact JSON
});

// vLLM's guided_* fields and the constraint kind each gives (the engine's Constraint.kind).
const GUIDED = { guided_json: 'json_schema', guided_regex: 'regex', guided_choice: 'choice', guided_grammar: 'grammar' };
const FORMAT_TYPES = ['text', 'json_object', 'json_schema'];
const JSON_SCHEMA_KEYS = ['name', 'schema', 'strict', 'description'];

const ID_RE = /^[\x21-\x7e]{1,200}$/; // printable ASCII without spaces: it becomes part of key names
// A lone UTF-16 half: JSON can spell it, UTF-8 cannot hold it. With the u flag a surrogate pair is one code
// point, outside the range: only halves match.
const LONE_SURROGATE_RE = /[\ud800-\udfff]/u;
const LONE_SURROGATES_RE = /[\ud800-\udfff]/gu;

// Bounds every worker can hold whatever its settings (producer/protocol.py; Limits holds the configurable
// ones): each value fits the integer or float32 that the engine turns it into.
const INT32_MAX = 2 ** 31 - 1;
const MAX_MODEL_CHARS = 256;
const MAX_TEMPERATURE = 100; // far past the point where sampling is uniform; keeps logits / temperature finite
const MIN_REPETITION_PENALTY = 0.01; // logits are multiplied or divided by it
const MAX_REPETITION_PENALTY = 100;
const MAX_LENGTH_PENALTY = 10; // beam search divides by length ** length_penalty, either sign
const MAX_TIMEOUT_S = 365 * 24 * 3600;

export function newId() {
  return randomUUID().replace(/-/g, '');
}

function fail(field, message) {
  throw new InvalidRequestError(`invalid job request: ${field}: ${message}`, field);
}

function show(v) {
  try {
    return v === undefined ? 'undefined' : JSON.stringify(v) ?? String(v);
  } catch {
    return String(v);
  }
}

function int(field, v, { min, max } = {}) {
  if (typeof v !== 'number' || !Number.isInteger(v)) fail(field, `must be an integer, got ${show(v)}`);
  if (min !== undefined && v < min) fail(field, `must be >= ${min}, got ${v}`);
  if (max !== undefined && v > max) fail(field, `must be <= ${max}, got ${v}`);
  // Past 2 ** 53 the number is not the integer it was meant to be, and JSON would send the rounded one.
  if (!Number.isSafeInteger(v)) {
    const safe = Number.MAX_SAFE_INTEGER;
    fail(field, `must be between -${safe} and ${safe} (larger integers are not exact in JavaScript), got ${v}`);
  }
  return v;
}

function num(field, v, { ge, gt, le } = {}) {
  if (typeof v !== 'number' || !Number.isFinite(v)) fail(field, `must be a finite number, got ${show(v)}`);
  if (ge !== undefined && v < ge) fail(field, `must be >= ${ge}, got ${v}`);
  if (gt !== undefined && v <= gt) fail(field, `must be > ${gt}, got ${v}`);
  if (le !== undefined && v > le) fail(field, `must be <= ${le}, got ${v}`);
  return v;
}

function isPlainObject(v) {
  if (v === null || typeof v !== 'object' || Array.isArray(v)) return false;
  const proto = Object.getPrototypeOf(v);
  return proto === Object.prototype || proto === null;
}

// Plain JSON only: objects, arrays, strings, finite numbers, true, false, null (no undefined, Date, Map,
// BigInt, NaN...), which JSON.stringify would otherwise drop or change without a word.
// `field`: the request field that holds `v` (metadata, a JSON schema), named in the error.
function checkJson(v, path, depth, field = 'metadata') {
  if (depth > 500) fail(field, `nested too deeply at ${path}`);
  if (v === null || typeof v === 'string' || typeof v === 'boolean') return;
  if (typeof v === 'number') {
    if (!Number.isFinite(v)) fail(field, `${path} is ${v}: ${field} must be plain JSON (finite numbers)`);
    return;
  }
  if (Array.isArray(v)) {
    v.forEach((x, i) => checkJson(x, `${path}[${i}]`, depth + 1, field));
    return;
  }
  if (isPlainObject(v)) {
    for (const [k, x] of Object.entries(v)) checkJson(x, `${path}.${k}`, depth + 1, field);
    return;
  }
  fail(field, `${path} is ${typeof v === 'object' ? v.constructor?.name ?? 'an object' : typeof v}: ${field} `
    + 'must be plain JSON (objects, arrays, strings, finite numbers, true, false, null)');
}

// OpenAI's response_format (producer/protocol.py JobRequest._check_response_format).
function checkResponseFormat(v) {
  if (v === null) return null;
  if (!isPlainObject(v)) fail('response_format', `must be an object {type, json_schema}, got ${show(v)}`);
  checkJson(v, 'response_format', 0, 'response_format');
  const kind = v.type;
  if (!FORMAT_TYPES.includes(kind)) {
    fail('response_format.type', `must be text, json_object or json_schema, got ${show(kind)}`);
  }
  const extra = Object.keys(v).filter((k) => k !== 'type' && !(kind === 'json_schema' && k === 'json_schema'));
  if (extra.length) fail('response_format', `of type ${kind} does not take ${extra.sort().join(', ')}`);
  if (kind !== 'json_schema') return v;
  const spec = v.json_schema;
  if (!isPlainObject(spec) || !Object.hasOwn(spec, 'schema')) {
    fail('response_format.json_schema', `must be an object with a schema (and a name), got ${show(spec)}`);
  }
  if (!isPlainObject(spec.schema) && typeof spec.schema !== 'boolean') {
    fail('response_format.json_schema.schema', `must be a JSON Schema object, got ${show(spec.schema)}`);
  }
  const unknown = Object.keys(spec).filter((k) => !JSON_SCHEMA_KEYS.includes(k));
  if (unknown.length) {
    fail('response_format.json_schema', `does not take ${unknown.sort().join(', ')} (it takes ${JSON_SCHEMA_KEYS.join(', ')})`);
  }
  return v;
}

// vLLM's guided_json: a JSON schema (an object, or true / false), or its JSON text.
function checkGuidedJson(v) {
  if (typeof v === 'string') {
    try {
      v = JSON.parse(v);
    } catch (e) {
      fail('guided_json', `is not valid JSON: ${e.message}`);
    }
  }
  if (v === null) return null;
  if (!isPlainObject(v) && typeof v !== 'boolean') {
    fail('guided_json', `must be a JSON schema (an object, true or false, or its JSON text), got ${show(v)}`);
  }
  checkJson(v, 'guided_json', 0, 'guided_json');
  return v;
}

function nonEmptyString(field, v) {
  if (v === null) return null;
  if (typeof v !== 'string' || !v) fail(field, `must be a non-empty string, got ${show(v)}`);
  return v;
}

function checkChoices(v) {
  if (v === null) return null;
  if (!Array.isArray(v) || !v.length) fail('guided_choice', `must be a non-empty array of strings, got ${show(v)}`);
  return v.map((c, i) => {
    if (typeof c !== 'string' || !c) fail(`guided_choice[${i}]`, `must be a non-empty string, got ${show(c)}`);
    return c;
  });
}

/**
 * [kind, spec, field] of what a request made by makeRequest must parse as (producer/protocol.py
 * JobRequest.constraint; kind is the engine's: json_schema, json_object, regex, choice, grammar), or null.
 */
export function constraintOf(req) {
  const type = req.response_format?.type;
  if (type === 'json_schema') return ['json_schema', req.response_format.json_schema.schema, 'response_format'];
  if (type === 'json_object') return ['json_object', null, 'response_format'];
  for (const [field, kind] of Object.entries(GUIDED)) {
    if (req[field] !== null && req[field] !== undefined) return [kind, req[field], field];
  }
  return null;
}

/**
 * [the dotted path, the code unit] of the first lone surrogate in any string of `value`, keys included, or null
 * (producer/protocol.py lone_surrogate). A walk with its own stack that visits each object once: a deep nest or
 * a cycle gets checkJson's clear error afterwards, not a stack overflow or a hang here. A key's lone surrogates
 * are spelled as JSON spells them (\ud800) in the path: the error message must be valid text itself.
 */
function loneSurrogate(value) {
  const todo = [['', value]];
  const seen = new Set();
  while (todo.length) {
    const [path, v] = todo.pop();
    if (typeof v === 'string') {
      const found = LONE_SURROGATE_RE.exec(v);
      if (found) return [path, found[0]];
    } else if (Array.isArray(v) || isPlainObject(v)) {
      if (seen.has(v)) continue;
      seen.add(v);
      if (Array.isArray(v)) {
        for (let i = v.length - 1; i >= 0; i--) todo.push([`${path}[${i}]`, v[i]]);
      } else {
        for (const [k, item] of Object.entries(v).reverse()) {
          const name = k.replace(LONE_SURROGATES_RE, (c) => `\\u${c.charCodeAt(0).toString(16)}`);
          const at = path ? `${path}.${name}` : name;
          todo.push([at, item], [at, k]);
        }
      }
    }
  }
  return null;
}

function codePoints(s) {
  let n = 0;
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c < 0xd800 || c > 0xdbff || i + 1 >= s.length) n++;
    else {
      const d = s.charCodeAt(i + 1);
      n++;
      if (d >= 0xdc00 && d <= 0xdfff) i++;
    }
  }
  return n;
}

/**
 * Validates `request` (a plain object with JobRequest's snake_case fields) against JobRequest and `limits`;
 * returns a new object with every field set (defaults filled in, a fresh id when none). Throws
 * InvalidRequestError naming the first bad field.
 */
export function makeRequest(request, limits = DEFAULT_LIMITS) {
  if (!isPlainObject(request)) fail('request', `must be a plain object, got ${show(request)}`);
  // A lone surrogate is a JavaScript string like any other, then fails wherever the text is encoded: the
  // tokenizer, Redis, a response. Refused first, as Python does, naming where it is.
  const found = loneSurrogate(request);
  if (found !== null) {
    const [where, char] = found;
    const code = char.charCodeAt(0).toString(16).toUpperCase().padStart(4, '0');
    fail(where || 'request', `text is not valid Unicode (a lone surrogate, U+${code}): send UTF-8 text`);
  }
  for (const k of Object.keys(request)) {
    if (!Object.hasOwn(DEFAULTS, k) && request[k] !== undefined) {
      fail(k, `unknown field (JobRequest has ${FIELDS.join(', ')})`);
    }
  }
  const get = (k) => (request[k] === undefined ? DEFAULTS[k] : request[k]);
  const req = {};

  req.id = request.id ?? newId();
  if (typeof req.id !== 'string' || !ID_RE.test(req.id)) {
    fail('id', `must be 1-200 printable ASCII characters without spaces, got ${show(req.id)}`);
  }
  req.model = get('model');
  if (req.model !== null && typeof req.model !== 'string') fail('model', `must be a string, got ${show(req.model)}`);
  if (req.model !== null && codePoints(req.model) > MAX_MODEL_CHARS) {
    fail('model', `must be at most ${MAX_MODEL_CHARS} characters, got ${codePoints(req.model)}`);
  }

  req.prompt = get('prompt');
  req.messages = get('messages');
  if ((req.prompt === null) === (req.messages === null)) {
    fail('prompt', 'give exactly one of prompt or messages');
  }
  if (req.prompt !== null) {
    if (typeof req.prompt !== 'string') fail('prompt', `must be a string, got ${show(req.prompt)}`);
    if (!req.prompt) fail('prompt', 'prompt is empty');
  } else {
    if (!Array.isArray(req.messages)) fail('messages', `must be an array of {role, content}, got ${show(req.messages)}`);
    if (!req.messages.length) fail('messages', 'messages is empty');
    req.messages = req.messages.map((m, i) => {
      const where = `messages[${i}]`;
      if (!isPlainObject(m)) fail(where, `must be an object {role, content}, got ${show(m)}`);
      for (const k of Object.keys(m)) {
        if (k !== 'role' && k !== 'content' && m[k] !== undefined) {
          fail(`${where}.${k}`, 'unknown field (a message has role, content)');
        }
      }
      if (typeof m.role !== 'string' || m.role.length < 1 || codePoints(m.role) > 64) {
        fail(`${where}.role`, `must be a string of 1-64 characters, got ${show(m.role)}`);
      }
      if (typeof m.content !== 'string') fail(`${where}.content`, `must be a string, got ${show(m.content)}`);
      return { role: m.role, content: m.content };
    });
  }

  req.max_tokens = int('max_tokens', get('max_tokens'), { min: 1, max: INT32_MAX });
  req.temperature = num('temperature', get('temperature'), { ge: 0, le: MAX_TEMPERATURE });
  req.top_p = num('top_p', get('top_p'), { gt: 0, le: 1 });
  req.top_k = int('top_k', get('top_k'), { min: -1, max: INT32_MAX });
  req.min_p = num('min_p', get('min_p'), { ge: 0, le: 1 });
  req.presence_penalty = num('presence_penalty', get('presence_penalty'), { ge: -2, le: 2 });
  req.frequency_penalty = num('frequency_penalty', get('frequency_penalty'), { ge: -2, le: 2 });
  req.repetition_penalty = num('repetition_penalty', get('repetition_penalty'),
    { ge: MIN_REPETITION_PENALTY, le: MAX_REPETITION_PENALTY });
  // Python bounds seed to int64. A number past 2 ** 53 is not the integer it was written as (2 ** 63 - 1 is
  // 2 ** 63), so int() takes safe integers only, all within int64: the seed needs no bound of its own.
  req.seed = get('seed') === null ? null : int('seed', get('seed'));
  req.n = int('n', get('n'), { min: 1, max: INT32_MAX });
  req.best_of = get('best_of') === null ? null : int('best_of', get('best_of'), { min: 1, max: INT32_MAX });
  req.use_beam_search = get('use_beam_search');
  if (typeof req.use_beam_search !== 'boolean') {
    fail('use_beam_search', `must be true or false, got ${show(req.use_beam_search)}`);
  }
  req.beam_width = get('beam_width') === null ? null
    : int('beam_width', get('beam_width'), { min: 1, max: INT32_MAX });
  req.length_penalty = num('length_penalty', get('length_penalty'), { ge: -MAX_LENGTH_PENALTY, le: MAX_LENGTH_PENALTY });
  req.early_stopping = get('early_stopping');
  if (![true, false, 'never'].includes(req.early_stopping)) {
    fail('early_stopping', `must be true, false or "never", got ${show(req.early_stopping)}`);
  }

  // At most one constraint (a response_format of type text is none), and none with beam search.
  req.response_format = checkResponseFormat(get('response_format'));
  req.guided_json = checkGuidedJson(get('guided_json'));
  req.guided_regex = nonEmptyString('guided_regex', get('guided_regex'));
  req.guided_choice = checkChoices(get('guided_choice'));
  req.guided_grammar = nonEmptyString('guided_grammar', get('guided_grammar'));
  const given = Object.keys(GUIDED).filter((k) => req[k] !== null);
  if ((req.response_format?.type ?? 'text') !== 'text') given.unshift('response_format');
  if (given.length > 1) fail(given[1], `give at most one constraint; got ${given.join(', ')}`);
  if (given.length && req.use_beam_search) {
    fail(given[0], `beam search does not take a constraint (${given[0]}): sample instead`);
  }

  let stop = get('stop');
  if (stop === null) stop = [];
  if (typeof stop === 'string') stop = [stop];
  if (!Array.isArray(stop) || stop.some((s) => typeof s !== 'string')) {
    fail('stop', `must be a string or an array of strings, got ${show(stop)}`);
  }
  req.stop = [...stop];

  const stopIds = get('stop_token_ids');
  if (!Array.isArray(stopIds)) fail('stop_token_ids', `must be an array of integers, got ${show(stopIds)}`);
  // Each below the model's vocabulary size too: the worker checks that, as only it knows the model.
  req.stop_token_ids = stopIds.map((t, i) => int(`stop_token_ids[${i}]`, t, { min: 0, max: INT32_MAX }));

  req.ignore_eos = get('ignore_eos');
  if (typeof req.ignore_eos !== 'boolean') fail('ignore_eos', `must be true or false, got ${show(req.ignore_eos)}`);
  req.speculative = get('speculative');
  if (typeof req.speculative !== 'boolean') fail('speculative', `must be true or false, got ${show(req.speculative)}`);
  req.logprobs = get('logprobs') === null ? null : int('logprobs', get('logprobs'), { min: 0, max: 20 });
  // The lane's stream it is queued on (read before the lanes below it); exactly one of LANES (null is refused,
  // as Python's Literal refuses None).
  req.lane = get('lane');
  if (!LANES.includes(req.lane)) fail('lane', `must be one of ${LANES.join(', ')}, got ${show(req.lane)}`);
  req.priority = int('priority', get('priority'), { min: -INT32_MAX, max: INT32_MAX }); // lower runs first
  // The fair-share group (a tenant, a customer): part of its stream's key name, hence the narrow alphabet.
  req.group = get('group');
  if (req.group !== null && (typeof req.group !== 'string' || !GROUP_NAME_RE.test(req.group))) {
    fail('group', `must be 1-128 characters of [A-Za-z0-9_.:@-], got ${show(req.group)}`);
  }
  req.timeout_s = get('timeout_s') === null ? null : num('timeout_s', get('timeout_s'), { gt: 0, le: MAX_TIMEOUT_S });

  req.metadata = get('metadata');
  if (!isPlainObject(req.metadata)) fail('metadata', `must be a plain object, got ${show(req.metadata)}`);
  checkJson(req.metadata, 'metadata', 0);

  checkLimits(req, { ...DEFAULT_LIMITS, ...limits });
  return req;
}

/** Continuations a job runs at once (producer/protocol.py JobRequest.width). */
export function widthOf(req) {
  if (req.use_beam_search) return req.beam_width ?? req.best_of ?? req.n;
  return req.best_of ?? req.n;
}

/** Throws InvalidRequestError naming the first limit `req` exceeds (producer/protocol.py Limits.check). */
export function checkLimits(req, limits) {
  const chars = req.prompt !== null ? codePoints(req.prompt)
    : req.messages.reduce((n, m) => n + codePoints(m.content), 0);
  if (chars > limits.max_prompt_chars) {
    fail(req.prompt !== null ? 'prompt' : 'messages', `prompt is ${chars} characters, the limit is ${limits.max_prompt_chars}`);
  }
  if (req.messages !== null && req.messages.length > limits.max_messages) {
    fail('messages', `${req.messages.length} messages, the limit is ${limits.max_messages}`);
  }
  if (req.max_tokens > limits.max_tokens) {
    fail('max_tokens', `max_tokens is ${req.max_tokens}, the limit is ${limits.max_tokens}`);
  }
  if (req.stop.length > limits.max_stop) fail('stop', `${req.stop.length} stop strings, the limit is ${limits.max_stop}`);
  const longest = req.stop.reduce((most, s) => Math.max(most, codePoints(s)), 0);
  if (longest > limits.max_stop_chars) {
    fail('stop', `a stop string is ${longest} characters, the limit is ${limits.max_stop_chars}`);
  }
  if (req.stop_token_ids.length > limits.max_stop_token_ids) {
    fail('stop_token_ids', `${req.stop_token_ids.length} stop_token_ids, the limit is ${limits.max_stop_token_ids}`);
  }
  if (req.n > limits.max_n) fail('n', `n is ${req.n}, the limit is ${limits.max_n}`);
  const width = widthOf(req);
  if (width > limits.max_width) {
    const field = req.use_beam_search ? 'beam_width' : 'best_of';
    fail(field, `${field} is ${width}, the limit is ${limits.max_width}`);
  }
  // Sizes are UTF-8 bytes of compact JSON, as Python's metadata_bytes measures them (a float such as 1.0 may
  // differ by a byte or two: the worker has the last word).
  const constraint = constraintOf(req);
  if (constraint !== null) {
    const [kind, spec, field] = constraint;
    const bytes = Buffer.byteLength(JSON.stringify(spec));
    if (bytes > limits.max_constraint_bytes) {
      fail(field, `the ${kind} constraint is ${bytes} bytes as JSON, the limit is ${limits.max_constraint_bytes}`);
    }
  }
  const size = Buffer.byteLength(JSON.stringify(req.metadata));
  if (size > limits.max_metadata_bytes) {
    fail('metadata', `metadata is ${size} bytes as JSON, the limit is ${limits.max_metadata_bytes}`);
  }
}

function isDefault(k, v) {
  const d = DEFAULTS[k];
  if (Array.isArray(d)) return v.length === 0;
  if (isPlainObject(d)) return Object.keys(v).length === 0;
  return v === d;
}

/** The wire form of a request made by makeRequest: JSON, fields in JobRequest's order, defaults left out. */
export function encodeRequest(req) {
  const out = {};
  for (const k of FIELDS) {
    if (k === 'id' || !isDefault(k, req[k])) out[k] = req[k];
  }
  return JSON.stringify(out);
}
