"""What each API key may do and what it did, kept in Redis so that every serve process sees the same: admission
against the key's rate limits, its cap on jobs per queue, and the settling of its jobs' usage once they end.

- Rate limits (producer/scripts/limit.lua): a request takes one from the key's requests-per-minute bucket and,
  for a completion, its charge from the tokens-per-minute bucket: the prompt, estimated at 4 characters a
  token (the server has no tokenizer), plus max_tokens. Once the job ends the charge is settled against what
  the job used (its result's usage): the difference goes back to the bucket, or is taken from it.
- The cap: an interactive job joins the key's jobs on its queue (Keys.owner_jobs) in the same script that
  submits it (submit.lua), which refuses it when the key has its cap of jobs there.
- Settling: a job leaves that set when a serve process has seen it end, and only the process whose ZREM took it
  out counts its usage and settles its charge: each job is counted once, whichever process, request or sweep
  sees it end. The request that submitted a job settles it when it reads the job's end; a job whose request went
  away (a client that left with an Idempotency-Key, a serve process that died) is settled by any serve
  process's sweep (`sweep`) once it is `settle_after_s` old, and at once by the next request of its key that
  finds the key at its cap. A process that dies between the ZREM and the count loses that one job's count.

Sans-IO flows (producer.flows), so that `pagedq usage` reads the same records without a server.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from producer import calls, flows, wire
from producer.calls import Owner, owner_member, parse_owner_member
from producer.errors import OwnerFull
from producer.flows import Cmd, Flow, Pipe
from producer.keys import ApiKeyKeys, Keys
from producer.protocol import JobRequest, JobResult, Usage
from serve.api_keys import ApiKey
from serve.config import ServeConfig
from serve.errors import APIError

CHARS_PER_TOKEN = 4  # OpenAI's rule of thumb for English text, the estimate of a prompt's tokens at admission
SWEEP_CHUNK = 500  # jobs of one key and queue looked at per sweep

# (key id, jobs, their usage): called for what a flow settled, for a process's own counters (Prometheus).
Tally = Callable[[str, int, Usage], None]


@dataclass(frozen=True)
class Limits:
    """A key's limits, 0 for none."""

    rpm: int = 0
    tpm: int = 0
    max_jobs: int = 0
    max_batches: int = 0
    max_file_bytes: int = 0

    @classmethod
    def of(cls, key: ApiKey | None, config: ServeConfig) -> Limits:
        if key is None:
            return cls()

        def pick(own: int | None, server: int | None) -> int:
            return own if own is not None else server or 0

        return cls(pick(key.rpm, config.key_rpm), pick(key.tpm, config.key_tpm),
                   pick(key.max_jobs, config.key_max_jobs), pick(key.max_batches, config.key_max_batches),
                   pick(key.max_file_bytes, config.key_max_file_bytes))


def estimate(req: JobRequest) -> int:
    """The tokens a request is charged at admission: its prompt, estimated, and max_tokens per continuation run."""
    chars = len(req.prompt) if req.prompt is not None else sum(len(m.content) for m in req.messages or [])
    return math.ceil(chars / CHARS_PER_TOKEN) + req.max_tokens * req.width


def job_id(key: ApiKey | None, idempotency_key: str | None) -> str | None:
    """The job id of a request: an Idempotency-Key is the key's own (two keys may send the same one and get two
    jobs); without one, a new random id (None)."""
    if idempotency_key is None or key is None:
        return idempotency_key
    return f"{key.id}.{idempotency_key}"


def _refused(key: ApiKey, limits: Limits, a: calls.Admission, tokens: int) -> APIError:
    if a.never:
        return APIError(429, f"Request too large for key {key.name}: it is charged {tokens} tokens (its prompt, at "
                        f"{CHARS_PER_TOKEN} characters a token, and max_tokens), more than its limit of "
                        f"{limits.tpm} tokens per minute; lower max_tokens", "tokens", code="rate_limit_exceeded")
    limit = f"{limits.rpm} requests" if a.limit == "requests" else f"{limits.tpm} tokens"
    seconds = max(1, math.ceil(a.wait_ms / 1000))
    return APIError(429, f"Rate limit reached for key {key.name}: {limit} per minute; retry in {seconds} s",
                    a.limit, code="rate_limit_exceeded",
                    headers={"Retry-After": str(seconds), "retry-after-ms": str(a.wait_ms)})


def admit(key: ApiKey, limits: Limits, tokens: int = 0) -> Flow:
    """Take a request (and `tokens`) from the key's buckets, or raise the 429 that says which limit and when."""
    a = yield from flows.run_call(calls.admit(ApiKeyKeys(key.id), limits.rpm, limits.tpm, tokens))
    if not a.ok:
        raise _refused(key, limits, a, tokens)


@dataclass(frozen=True)
class Ticket:
    """An interactive job a key submitted, and what its admission charged: what settling it needs."""

    key: ApiKey
    limits: Limits
    keys: Keys
    job_id: str
    charged: int


def submit(keys: Keys, req: JobRequest, key: ApiKey, limits: Limits, charged: int, retry_after_s: int,
           tally: Tally | None = None) -> Flow:
    """Submit the job as the key's, within its cap (pruning the key's jobs that ended unseen first, if it is at
    it); returns its Ticket. A 429 (its charge given back) when the key has its cap of jobs queued or running."""
    owner = Owner(key.id, limits.max_jobs, charged)
    for attempt in range(2):
        out, = yield from flows.run_calls([calls.submit(keys, req, owner)])
        if not isinstance(out, OwnerFull):
            break
        if attempt == 0:
            yield from prune(keys, key.id, limits, tally)
    if isinstance(out, Exception):
        yield from refund(key, limits, charged)
        if isinstance(out, OwnerFull):
            raise _full(keys, key, limits, retry_after_s)
        raise out
    return Ticket(key, limits, keys, req.id, charged)


def _full(keys: Keys, key: ApiKey, limits: Limits, retry_after_s: int) -> APIError:
    return APIError(429, f"key {key.name} has {limits.max_jobs} jobs queued or running on queue {keys.queue}, its "
                    "limit; retry when one has ended", "rate_limit_exceeded", code="key_queue_full",
                    headers={"Retry-After": str(retry_after_s)})


def room(keys: Keys, key: ApiKey, limits: Limits, retry_after_s: int, tally: Tally | None = None) -> Flow:
    """Raise the 429 of a key that has its cap of jobs on the queue (once those that ended unseen are settled).
    A look before anything costly is done for the request; `submit` holds the cap again, atomically."""
    if not limits.max_jobs:
        return
    held = yield Cmd("zcard", (keys.owner_jobs(key.id),))
    if held >= limits.max_jobs:
        held -= yield from prune(keys, key.id, limits, tally)
    if held >= limits.max_jobs:
        raise _full(keys, key, limits, retry_after_s)


def refund(key: ApiKey, limits: Limits, tokens: int) -> Flow:
    """Return a charge whose request was turned away after its admission."""
    if tokens and limits.tpm:
        yield from flows.run_call(calls.settle(ApiKeyKeys(key.id), limits.rpm, limits.tpm, tokens, 0, Usage()))


def total_usage(raws: Iterable[str | None]) -> Usage:
    """The usage of jobs summed from their results as stored (None: a job without one, which counts nothing)."""
    p = c = k = 0
    for raw in raws:
        if isinstance(raw, str):
            u = JobResult.model_validate_json(raw).usage
            p, c, k = p + u.prompt_tokens, c + u.completion_tokens, k + u.cached_tokens
    return Usage(prompt_tokens=p, completion_tokens=c, cached_tokens=k)


def used(u: Usage) -> int:
    return u.prompt_tokens + u.completion_tokens


def settle(t: Ticket, res: JobResult | None) -> Flow:
    """The submitting request saw its job end: count its usage and settle its charge, unless another process
    did. Returns the usage counted (None: someone else had)."""
    if not (yield Cmd("zrem", (t.keys.owner_jobs(t.key.id), owner_member(t.job_id, t.charged)))):
        return None
    u = res.usage if res is not None else Usage()
    yield from flows.run_call(calls.settle(ApiKeyKeys(t.key.id), t.limits.rpm, t.limits.tpm, t.charged - used(u),
                                           1, u))
    return u


def count(key_id: str, jobs: int, usage: Usage, limits: Limits = Limits(), give_back: int = 0,
          tally: Tally | None = None) -> Flow:
    """Count `jobs` ended jobs of a key (`usage`: theirs, summed) and give `give_back` tokens of their charges
    back to its bucket."""
    if jobs:
        yield from flows.run_call(calls.settle(ApiKeyKeys(key_id), limits.rpm, limits.tpm, give_back, jobs, usage))
        if tally:
            tally(key_id, jobs, usage)


def _ended(state: str | None) -> bool:
    return state is None or state in wire.TERMINAL_STATES


def _live(keys: Keys, key_id: str, older_than: float | None) -> Cmd:
    """The key's jobs on the queue (those enqueued before `older_than`, unix s), a chunk of them."""
    top = "+inf" if older_than is None else repr(older_than)
    return Cmd("zrangebyscore", (keys.owner_jobs(key_id), "-inf", top), {"start": 0, "num": SWEEP_CHUNK})


def _settle_ended(keys: Keys, key_id: str, limits: Limits, members: list[str], tally: Tally | None) -> Flow:
    """Of the key's jobs `members`, settle those that ended. Returns how many this process settled."""
    jobs = [parse_owner_member(m) for m in members]
    states = yield Pipe([Cmd("hget", (keys.job(j), wire.F_STATE)) for j, _ in jobs])
    ended = [(m, j, c) for m, (j, c), s in zip(members, jobs, states, strict=True) if _ended(s)]
    if not ended:
        return 0
    raws = yield Pipe([Cmd("get", (keys.result(j),)) for _, j, _ in ended])
    removed = yield Pipe([Cmd("zrem", (keys.owner_jobs(key_id), m)) for m, _, _ in ended])
    # Only what this process took out is this process's to count.
    mine = [(c, raw) for (_, _, c), raw, took in zip(ended, raws, removed, strict=True) if took]
    total = total_usage(raw for _, raw in mine)
    yield from count(key_id, len(mine), total, limits, sum(c for c, _ in mine) - used(total), tally)
    return len(mine)


def prune(keys: Keys, key_id: str, limits: Limits, tally: Tally | None = None) -> Flow:
    """Settle the key's jobs on this queue that ended without their request seeing it (a key at its cap)."""
    members = yield _live(keys, key_id, None)
    return (yield from _settle_ended(keys, key_id, limits, members, tally)) if members else 0


def sweep(queues: Iterable[str], limits_of: Callable[[str], Limits], settle_after_s: float,
          tally: Tally | None = None) -> Flow:
    """Settle, on each of `queues`, the jobs of every known key that ended unseen and are `settle_after_s` old
    (each serve process runs this now and then). Returns how many it settled."""
    ids = yield Cmd("zrange", (ApiKeyKeys.index, 0, -1))
    pairs = [(Keys(q), i) for q in queues for i in ids]
    if not pairs:
        return 0
    older_than = time.time() - settle_after_s
    found = yield Pipe([_live(keys, i, older_than) for keys, i in pairs])
    n = 0
    for (keys, key_id), members in zip(pairs, found, strict=True):
        if members:
            n += yield from _settle_ended(keys, key_id, limits_of(key_id), members, tally)
    return n


def register(keys: Iterable[ApiKey]) -> Flow:
    """Name each key in its usage record and list it where `pagedq usage` looks (at start and on reload)."""
    now = int(time.time())
    ops = []
    for k in keys:
        names = ApiKeyKeys(k.id)
        ops += [Cmd("hset", (names.usage, wire.USAGE_NAME, k.name)), Cmd("zadd", (ApiKeyKeys.index, {k.id: now}))]
    if ops:
        yield Pipe(ops)


def report() -> Flow:
    """Every key's usage record, by name: `pagedq usage`."""
    ids = yield Cmd("zrange", (ApiKeyKeys.index, 0, -1))
    records = (yield Pipe([Cmd("hgetall", (ApiKeyKeys(i).usage,)) for i in ids])) if ids else []
    out = []
    for key_id, rec in zip(ids, records, strict=True):
        row = {"key": rec.get(wire.USAGE_NAME) or key_id, "key_id": key_id}
        row |= {c: int(rec.get(c) or 0) for c in wire.USAGE_COUNTERS}
        row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
        out.append(row)
    return sorted(out, key=lambda r: r["key"])
