// Types of pagedq's JavaScript client. The wire objects (JobRequest, JobResult, StreamEvent) keep the snake_case
// field names of producer/protocol.py, so that they read the same in Python, in Redis and in JavaScript.

import type { RedisClientType } from 'redis';

export type JobStatus = 'queued' | 'running' | 'completed' | 'failed' | 'cancelled' | 'expired';
export type TerminalStatus = 'completed' | 'failed' | 'cancelled' | 'expired';
export type FinishReason = 'stop' | 'length' | 'cancelled' | 'error' | 'expired';
/** A queue's priority lanes, most urgent first (producer/keys.py LANES). */
export type Lane = 'interactive' | 'default' | 'batch';
export type JsonValue = string | number | boolean | null | JsonValue[] | { [key: string]: JsonValue };

/** A JSON Schema: an object (`{type: 'object', properties: {...}, required: [...]}`), or true / false. */
export type JsonSchema = { [key: string]: JsonValue } | boolean;

/**
 * OpenAI's response_format. `text`: no constraint. `json_object`: any JSON object. `json_schema`: JSON that
 * matches `json_schema.schema`. JSON is generated without free whitespace.
 */
export type ResponseFormat =
  | { type: 'text' }
  | { type: 'json_object' }
  | {
    type: 'json_schema';
    json_schema: {
      /** OpenAI requires it; pagedq does not use it. */
      name?: string;
      schema: JsonSchema;
      strict?: boolean | null;
      description?: string;
    };
  };

export interface Message {
  role: string;
  content: string;
}

/**
 * One generation job (producer/protocol.py JobRequest). Give exactly one of `prompt` and `messages`. Every string
 * in it (prompt, messages, stop, model, constraints, metadata keys and values) must be valid Unicode: a lone
 * surrogate ('\ud800') is refused, naming where it is (`metadata.a[1]`); surrogate pairs (emoji) are fine.
 * Integers must be safe integers (`Number.isSafeInteger`). The sampling fields (max_tokens ... speculative) are
 * producer/sampling_fields.py's table; tests/queue/test_sampling_fields.py holds their names and types here to it.
 */
export interface JobRequest {
  /** The idempotency key: a second submit with the same id is refused. Default: a fresh random id. */
  id?: string | null;
  /** null: whatever model the queue's workers serve. At most 256 characters. */
  model?: string | null;
  prompt?: string | null;
  messages?: Message[] | null;
  /** Default 256; at most `limits.max_tokens` (32768). */
  max_tokens?: number;
  /** Default 1.0; 0 is greedy; at most 100. */
  temperature?: number;
  top_p?: number;
  /** 0 or -1: off. */
  top_k?: number;
  min_p?: number;
  /**
   * Python takes any int64; here a safe integer (within +-(2^53 - 1)), as a larger number is not exact in
   * JavaScript.
   */
  seed?: number | null;
  /** At most `limits.max_stop` (16) strings of at most `limits.max_stop_chars` (1000) characters each. */
  stop?: string | string[] | null;
  /** Each 0 to 2^31 - 1; at most `limits.max_stop_token_ids` (256) of them. */
  stop_token_ids?: number[];
  ignore_eos?: boolean;
  logprobs?: number | null;
  /** OpenAI's, -2 to 2. */
  presence_penalty?: number;
  /** OpenAI's, -2 to 2. */
  frequency_penalty?: number;
  /** vLLM's, 0.01 to 100: above 1 discourages repeats; 1 is off. */
  repetition_penalty?: number;
  /** Continuations returned (default 1, at most 16); they share the prompt's KV blocks. */
  n?: number;
  /** Continuations run; the n of highest cumulative logprob returned. Default: n. */
  best_of?: number | null;
  /** Beam search (greedy: temperature 0), as transformers' generate(num_beams=...). */
  use_beam_search?: boolean;
  /** Beams; default best_of, else n. */
  beam_width?: number | null;
  /** Beam search divides by length ** length_penalty: -10 to 10, default 1.0. */
  length_penalty?: number;
  early_stopping?: boolean | 'never';
  /** false: never speculates on a worker started with --speculative (its tokens are the same either way). */
  speculative?: boolean;
  /**
   * Structured output: give at most one of `response_format` (type `text` does not count) and the `guided_*`
   * fields, and none with `use_beam_search`. The worker masks every token the constraint does not allow; the
   * output ends (finish_reason "stop") where the constraint is complete. A constraint that does not compile
   * fails the job (error type `invalid_request`, the grammar engine's message). At most
   * `limits.max_constraint_bytes` (65536) as compact JSON. Default null.
   */
  response_format?: ResponseFormat | null;
  /** vLLM's: a JSON schema the output must match, or its JSON text. Default null. */
  guided_json?: JsonSchema | string | null;
  /** vLLM's: a regular expression the whole output must match (non-empty). Default null. */
  guided_regex?: string | null;
  /** vLLM's: the output is exactly one of these non-empty strings. Default null. */
  guided_choice?: string[] | null;
  /** vLLM's: a grammar the output must parse as, in Lark or GBNF (llama.cpp's) syntax (non-empty). Default null. */
  guided_grammar?: string | null;
  /**
   * The lane's stream it is queued on: workers read `interactive` first, then `default`, then `batch` (with a
   * floor share for the lower ones). Default "default".
   */
  lane?: Lane;
  /** Lower runs first, within a worker's batch; -(2^31 - 1) to 2^31 - 1. */
  priority?: number;
  /**
   * The fair-share group (a tenant, a customer): 1-128 characters of [A-Za-z0-9_.:@-]. A lane's groups share the
   * workers by weight (`pagedq groups`). Default null: none.
   */
  group?: string | null;
  /** Seconds from enqueue, above 0 and at most a year (31536000); past it the job expires. */
  timeout_s?: number | null;
  /** Opaque to the worker; echoed in the result. */
  metadata?: { [key: string]: JsonValue };
}

/** Size limits checked at submit (producer/protocol.py Limits); the worker checks them again. */
export interface Limits {
  max_prompt_chars: number;
  max_messages: number;
  max_tokens: number;
  max_metadata_bytes: number;
  max_stop: number;
  /** The longest stop string, in characters (code points). Default 1000. */
  max_stop_chars: number;
  /** How many stop_token_ids. Default 256. */
  max_stop_token_ids: number;
  max_n: number;
  max_width: number;
  /** A constraint's schema, regex, grammar or choices, as UTF-8 bytes of compact JSON. Default 65536. */
  max_constraint_bytes: number;
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  cached_tokens: number;
}

/** Unix times in seconds. enqueued_at is the producer's clock; the others are the worker's. */
export interface Timings {
  enqueued_at: number | null;
  started_at: number | null;
  first_token_at: number | null;
  finished_at: number | null;
}

export interface ErrorInfo {
  /** invalid_request | unknown_model | limit_exceeded | engine_error | max_attempts | ... */
  type: string;
  message: string;
}

export interface TokenLogprob {
  token_id: number;
  logprob: number;
  top: { [tokenId: string]: number };
}

/** One continuation of a job with several (producer/protocol.py Choice). */
export interface Choice {
  index: number;
  text: string;
  token_ids: number[];
  finish_reason: FinishReason | null;
  logprobs: TokenLogprob[] | null;
  /** Where the engine ranked by it: best_of, beam search. */
  cumulative_logprob: number | null;
}

/** A job's final result (producer/protocol.py JobResult), every field present. */
export interface JobResult {
  id: string;
  status: JobStatus;
  text: string;
  token_ids: number[];
  finish_reason: FinishReason | null;
  usage: Usage;
  timings: Timings;
  worker: string | null;
  attempts: number;
  error: ErrorInfo | null;
  model: string | null;
  logprobs: TokenLogprob[] | null;
  metadata: { [key: string]: JsonValue };
  /** A job with several continuations: each, by index (text, token_ids, ... above are choices[0]'s); else null. */
  choices: Choice[] | null;
}

interface EventBase {
  /** The event's stream entry id: pass it as `after` to resume after it (SSE's Last-Event-ID). null for a
   * terminal event rebuilt from the stored result after the job's events expired. */
  event_id: string | null;
  /** A token event's offset: the job's output tokens before it (its stream entry's); null for others. */
  offset: number | null;
  logprobs: TokenLogprob[] | null;
}

export interface TokenEvent extends EventBase {
  type: 'token';
  /** The new text. */
  text: string;
  /** The new token ids. */
  token_ids: number[];
  /** Which continuation (0 in a job with one). */
  index: number;
  /** In a job with several continuations: this one ended here. */
  finish_reason: FinishReason | null;
  result: null;
}

/** The last event of every job: "done" (completed), "error" (failed or expired) or "cancelled". */
export interface TerminalEvent extends EventBase {
  type: 'done' | 'error' | 'cancelled';
  text: string;
  token_ids: number[];
  index: number;
  finish_reason: FinishReason | null;
  result: JobResult;
}

export type StreamEvent = TokenEvent | TerminalEvent;

export interface ClientOptions {
  /**
   * Default: $REDIS_URL, else redis://localhost:6379/0. Ignored when `redis` is given.
   * `redis+sentinel://[user:pass@]host1:26379,host2:26379/<service>[/<db>]` (or rediss+sentinel://) finds the
   * primary through Sentinel and follows it after a failover.
   */
  url?: string;
  /** Default "default": 1-128 characters of [A-Za-z0-9_.:-]. */
  queue?: string;
  /** Seconds a cancelled queued job's result and events are kept. Default 86400. */
  resultTtl?: number;
  /** Overrides of the default Limits. */
  limits?: Partial<Limits>;
  /**
   * A node-redis client to use (the caller closes it); blocking reads use duplicates of it. Give it
   * `disableOfflineQueue: true` for the grace to bound each wait (its offline queue holds commands without a limit).
   */
  redis?: RedisClientType<any, any, any, any, any>;
  /** Called with connection errors (the client reconnects by itself); default: ignored. */
  onError?: (err: Error) => void;
  /**
   * Milliseconds each Redis operation of a call rides through an outage (a restart, a Sentinel failover): sent
   * again with backoff (50 ms doubling to 1 s) until it gets through, else RedisUnavailable. Default
   * DEFAULT_GRACE_MS (30 s); 0: fail at once. A wrong password, a missing permission or a TLS certificate error is
   * no outage: it fails at once.
   */
  graceMs?: number;
}

export interface WaitOptions {
  /** Give up with TimeoutError after this long; default: wait for ever. */
  timeoutMs?: number;
  /** Stops the wait (it rejects with the signal's reason), e.g. when the HTTP client went away. */
  signal?: AbortSignal;
}

export interface StreamOptions extends WaitOptions {
  /** Resume after this event id (a stream entry id, e.g. SSE's Last-Event-ID). Default "0-0": from the start. */
  after?: string;
  /** A job with several continuations: only this one's token events (the terminal event comes as ever). */
  choice?: number;
}

export type CancelReply = 'cancelled' | 'cancelling' | TerminalStatus;

export class Client {
  constructor(options?: ClientOptions);
  readonly queue: string;
  readonly keys: Keys;
  readonly redis: RedisClientType<any, any, any, any, any>;
  readonly resultTtl: number;
  readonly limits: Limits;
  /** How long an outage may last before a call throws RedisUnavailable (ms). */
  readonly graceMs: number;
  /** Connects now (every method connects on first use anyway). */
  connect(): Promise<this>;
  /** Enqueues one job. Throws InvalidRequestError, DuplicateJobError; a submit retried through an outage that
   * finds its own job stored (its first reply was lost) succeeds: the job id is the idempotency key. */
  submit(request: JobRequest): Promise<Job>;
  /** Enqueues many jobs in one round trip. Throws DuplicateJobError (listing the refused ids; `jobs` holds the
   * submitted ones) after submitting every other job. */
  submitMany(requests: Iterable<JobRequest>): Promise<Job[]>;
  job(jobId: string): Job;
  /** Throws JobNotFound. */
  status(jobId: string): Promise<JobStatus>;
  /** Waits for the final result (blocking XREAD, no polling). Throws TimeoutError, JobNotFound. */
  result(jobId: string, options?: WaitOptions): Promise<JobResult>;
  /** Token events, then exactly one terminal event. Throws TimeoutError, JobNotFound. */
  stream(jobId: string, options?: StreamOptions): AsyncGenerator<StreamEvent, void, undefined>;
  /** "cancelled" (it was queued), "cancelling" (it runs; its worker stops it), or its final state unchanged. */
  cancel(jobId: string): Promise<CancelReply>;
  /** Closes the client's connections (not a `redis` passed in). */
  close(): Promise<void>;
  [Symbol.asyncDispose](): Promise<void>;
}

export function createClient(options?: ClientOptions): Client;

/** A handle on one job. */
export class Job {
  constructor(client: Client, jobId: string);
  readonly client: Client;
  readonly id: string;
  status(): Promise<JobStatus>;
  result(options?: WaitOptions): Promise<JobResult>;
  stream(options?: StreamOptions): AsyncGenerator<StreamEvent, void, undefined>;
  cancel(): Promise<CancelReply>;
  toJSON(): { id: string };
}

/** The key names of one queue (producer/keys.py). */
export class Keys {
  constructor(queue: string);
  readonly queue: string;
  readonly base: string;
  readonly jobs: string;
  readonly dlq: string;
  /** The consumer group of the workers ("workers"), not a fair-share group. */
  readonly group: string;
  /** Hash: fair-share group -> its settings as JSON ({"weight": w, "max_running": n}). */
  readonly groups: string;
  /** Stream: rung once per job queued to a group's stream, to wake idle workers. */
  readonly bell: string;
  /** The stream of a lane (default "default") and group (default none); `jobs` for the default lane without one. */
  stream(lane?: Lane, group?: string | null): string;
  /** The lanes' own streams, most urgent first. */
  laneStreams(): string[];
  /** Set: the groups that have a stream in the lane. */
  laneGroups(lane: Lane): string;
  /** Set: the groups of the lane whose streams may hold jobs no worker has read yet. */
  ready(lane: Lane): string;
  job(jobId: string): string;
  events(jobId: string): string;
  result(jobId: string): string;
}

export function checkQueue(queue: string): string;
/** Returns `lane`, or throws a TypeError when it is not one of LANES. */
export function checkLane(lane: string): Lane;
/** Returns `group`, or throws a TypeError when it is not 1-128 characters of [A-Za-z0-9_.:@-]. */
export function checkGroup(group: string): string;
export const LANES: readonly Lane[];
export const DEFAULT_LANE: 'default';
/** A group name's pattern, as producer/keys.py spells it (a RegExp source). */
export const GROUP_NAME_PATTERN: string;
export const PREFIX: string;
export const GROUP: string;
export const STATES: readonly JobStatus[];
export const TERMINAL_STATES: readonly TerminalStatus[];
export const TERMINAL_EVENT: { readonly [S in TerminalStatus]: TerminalEvent['type'] };
export const DEFAULT_URL: string;

/** Whether `url` is a redis+sentinel:// or rediss+sentinel:// URL. */
export function isSentinelUrl(url: string): boolean;
/** node-redis createSentinel() options from a Sentinel URL; a TypeError says what is wrong with a bad one. */
export function parseSentinelUrl(url: string): {
  name: string;
  sentinelRootNodes: Array<{ host: string; port: number }>;
  nodeClientOptions: { database: number; username?: string; password?: string; socket?: { tls: true } };
  sentinelClientOptions: { username?: string; password?: string; socket?: { tls: true } };
};
export const DEFAULT_TTL: number;
export const DEFAULT_LIMITS: Readonly<Limits>;

/** A validated request with every field set (defaults filled in, an id made). Throws InvalidRequestError. */
export function makeRequest(request: JobRequest, limits?: Partial<Limits>): Required<Omit<JobRequest, 'stop' | 'guided_json'>> & {
  id: string;
  stop: string[];
  /** Parsed, when given as JSON text. */
  guided_json: JsonSchema | null;
};
/** The wire JSON of a request made by makeRequest (fields that hold their default left out). */
export function encodeRequest(request: ReturnType<typeof makeRequest>): string;
export function newId(): string;
export function normalizeResult(result: Partial<JobResult> & { id: string; status: JobStatus }): JobResult;
export function parseEvent(entryId: string, fields: string[]): StreamEvent;

export class PagedqError extends Error {}
export class DuplicateJobError extends PagedqError {
  /** The refused ids. */
  readonly ids: string[];
  /** submitMany: the jobs that were submitted. */
  readonly jobs: Job[];
}
export class JobNotFound extends PagedqError {
  readonly jobId: string;
}
export class InvalidRequestError extends PagedqError {
  /** The offending field, e.g. "max_tokens" or "messages[0].role". */
  readonly field: string;
}
export class TimeoutError extends PagedqError {
  readonly jobId: string;
}
/**
 * Redis stayed unreachable longer than the client's grace: "Redis at <url, password redacted> unreachable for
 * <n> s (the client's grace is <g> s): <last error>". `cause`: that last error.
 */
export class RedisUnavailable extends PagedqError {
  /** Seconds since the outage began. */
  readonly waited: number;
}
/** The default grace: 30000 ms. */
export const DEFAULT_GRACE_MS: number;
