"""The names of the wire protocol: job states, the fields of every hash and stream entry, event types and
the error codes of the Lua scripts; and the token event's encoder and decoder, side by side. The scripts spell the
same names (tests/queue/test_lua_scripts.py, test_wire_names_match_the_scripts, checks that every name a script uses
is declared here); PROTOCOL.md documents them for producers in other languages.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import NamedTuple

# ---- job states (the `state` field of the job hash) ----
QUEUED = "queued"  # in the jobs stream, not yet started (or handed back)
RUNNING = "running"  # a worker holds it under a lease
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
EXPIRED = "expired"
STATES = (QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED, EXPIRED)
TERMINAL_STATES = (COMPLETED, FAILED, CANCELLED, EXPIRED)

# ---- fields of a jobs-stream entry ----
ENTRY_ID = "id"  # the job id (optional for a foreign producer: the entry id is used then)
ENTRY_JOB = "job"  # the JobRequest as JSON

# ---- fields of the job hash pq:{q}:job:<id> ----
F_STATE = "state"
F_ENTRY = "entry"  # the job's current stream entry id
F_ENQUEUED_AT = "enqueued_at"  # unix seconds, the producer's clock
F_ATTEMPTS = "attempts"  # deliveries that started it
F_HANDBACKS = "handbacks"  # deliveries handed back by a draining worker (not the job's fault)
F_LEASE = "lease"  # the token of the worker that holds it
F_LEASE_UNTIL_MS = "lease_until_ms"  # Redis time (ms) after which another worker may take it over
F_WORKER = "worker"  # id of the worker that holds (or last held) it
F_STARTED_AT = "started_at"  # unix seconds, the worker's clock
F_EMITTED = "emitted"  # output tokens its event stream holds
F_CANCEL = "cancel"  # set by a client while it runs: its worker stops it at the next step
F_LAST_ERROR = "last_error"  # why its last delivery gave it back ("type: message")
F_OWNER = "owner"  # the key id of the `pagedq serve` API key that submitted it (absent: no key)
F_STREAM = "stream"  # the stream it is queued on: its lane's or its group's (absent: pq:{q}:jobs)
JOB_FIELDS = (F_STATE, F_ENTRY, F_ENQUEUED_AT, F_ATTEMPTS, F_HANDBACKS, F_LEASE, F_LEASE_UNTIL_MS, F_WORKER,
              F_STARTED_AT, F_EMITTED, F_CANCEL, F_LAST_ERROR, F_OWNER, F_STREAM)

# ---- the hashes of an API key of `pagedq serve` (producer.keys.ApiKeyKeys), written by limit.lua ----
LIMIT_FIELDS = ("req", "tok", "at")  # its rate-limit buckets (requests, tokens) and when they were last filled
USAGE_NAME = "name"  # the key's name (written by serve, not a counter)
USAGE_COUNTERS = ("requests", "rate_limited", "jobs", "prompt_tokens", "completion_tokens", "cached_tokens")

# ---- the event stream pq:{q}:events:<id>: a field holding the event's JSON; a token event's entry also holds its
# offset (the job's output tokens before it), by which a reader skips chunks a failover made the worker write again
EVENT_FIELD = "e"
OFFSET_FIELD = "o"
EV_TOKEN = "token"
EV_DONE = "done"
EV_ERROR = "error"
EV_CANCELLED = "cancelled"
# The terminal event type of each final state.
TERMINAL_EVENT = {COMPLETED: EV_DONE, FAILED: EV_ERROR, CANCELLED: EV_CANCELLED, EXPIRED: EV_ERROR}


class TokenEvent(NamedTuple):
    """A token event as a worker reads back what earlier deliveries of a job streamed."""

    index: int  # which continuation (0 in a job with one)
    token_ids: list[int]
    text: str
    finish_reason: str | None  # in a job with several: the continuation ended here


def token_event(text: str, token_ids: list[int], logprobs: list[dict] | None = None, index: int | None = None,
                finish_reason: str | None = None) -> str:
    """A token event's JSON, as the worker writes it (index and finish_reason: only in a job with several
    continuations; logprobs: TokenLogprob dicts)."""
    if logprobs is None and index is None:  # the hot case, a job per step: a format string, no generic encoder
        return f'{{"type":"token","text":{encode_basestring(text)},"token_ids":[{",".join(map(str, token_ids))}]}}'
    event: dict = {"type": EV_TOKEN, "text": text, "token_ids": token_ids}
    if logprobs is not None:
        event["logprobs"] = logprobs
    if index is not None:
        event["index"] = index
        if finish_reason is not None:
            event["finish_reason"] = finish_reason
    return json.dumps(event)


def read_token_event(raw: str) -> TokenEvent | None:
    """A token event from its JSON (token_event's); None for any other event."""
    ev = json.loads(raw)
    if ev.get("type") != EV_TOKEN:
        return None
    return TokenEvent(ev.get("index", 0), ev.get("token_ids", []), ev.get("text", ""), ev.get("finish_reason"))

# ---- fields of a dead letter (an entry of pq:{q}:dlq) ----
DLQ_FIELDS = ("id", "error", "reason", "attempts", "worker", "at", "job")

# ---- the first word of each error reply a script may give ----
ERR_DUPLICATE = "DUPLICATE"  # submit: the job id exists
ERR_NOT_FOUND = "NOT_FOUND"  # cancel, retry: no such job or dead letter
ERR_LEASE_LOST = "LEASE_LOST"  # complete, fail, release: the caller no longer holds the job
ERR_NO_PAYLOAD = "NO_PAYLOAD"  # retry: the dead letter holds no job JSON
ERR_BUSY = "BUSY"  # retry: a job with this id is live again
ERR_GAP = "GAP"  # complete: the event stream lacks tokens the worker wrote (a failover lost them): send them again
ERR_FULL = "FULL"  # submit: the API key that submits it has as many jobs queued or running as it may
ERRORS = (ERR_DUPLICATE, ERR_NOT_FOUND, ERR_LEASE_LOST, ERR_NO_PAYLOAD, ERR_BUSY, ERR_FULL, ERR_GAP)

# ---- release modes ----
HANDBACK = "handback"
RETRY = "retry"
