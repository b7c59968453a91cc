"""Creating a batch from an uploaded file, cheap checks first: the key's cap on unended batches (429), the file's
lines counted against max_batch_lines (400, before anything is stored). Then the batch is stored, validating,
and its lines are read in another process (serve.cpu_process, through flows.Offload), a chunk at a time: each becomes its job or its error
line (serve.batch_lines), stored as it goes; then its jobs are submitted (serve.progress.submit_jobs).

A batch never stays validating: an exception while its lines are read fails it, the reason in its `errors`; a
creator that dies leaves its submitting lease to lapse, and the process that moves the batch on next submits its
jobs (its lines were all stored) or fails it (they were not). Sans-IO flows (producer.flows).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from producer import calls, flows
from producer.flows import Cmd, Flow, Offload, Pipe
from producer.keys import ApiKeyKeys, BatchKeys
from serve import batch_store, cpu_process, files, progress
from serve.batch_lease import CREATOR_LEASE_MS, Holder, LeaseLost
from serve.batch_lines import forget_reader, read_chunk, request_lines
from serve.batch_store import FAILED, QUEUES, VALIDATED, VALIDATING
from serve.config import ServeConfig
from serve.errors import APIError, bad_request, not_found

log = logging.getLogger("pagedq.serve")
READ_CHUNK = 1000  # lines read (validated) per step off the event loop, then stored


def create(config: ServeConfig, input_file_id: str, endpoint: str, window_s: int, asked: dict,
           owner: str | None = None, max_batches: int = 0, top_priority: int | None = None) -> Flow:
    """Create a batch of the file's lines (`asked`: the fields of its hash the request gave) as key id `owner`'s
    (within its cap of `max_batches` unended batches, 0: none; its lines may ask for a priority down to
    `top_priority`, None: any) and submit its jobs, in the batch lane and the owner's group; returns its id."""
    batch_id = batch_store.new_id()
    now = int(time.time())
    if owner:
        yield from _reserve(batch_id, owner, max_batches, now + config.store_ttl_s)
    try:
        lines = yield from _request_lines(config, input_file_id, owner)
    except APIError:
        if owner:
            yield from batch_store.ended(batch_id, owner)
        raise
    holder = Holder(CREATOR_LEASE_MS)  # this call's own: the process's sweeper must not take it for its own
    fields = asked | {"id": batch_id, "input_file_id": input_file_id, "endpoint": endpoint, "created_at": now,
                      "expires_at": now + window_s, "total": len(lines), "line_errors": 0, "status": VALIDATING,
                      "ttl": config.store_ttl_s} | ({files.OWNER: owner} if owner else {})
    if not lines:
        fields.update(status=FAILED, failed_at=now,
                      errors=json.dumps([{"code": "empty_file", "message": "the input file holds no request"}]))
    yield from _store(batch_id, fields, owner, config.store_ttl_s, holder)
    if not lines:
        if owner:
            yield from batch_store.ended(batch_id, owner)
        return batch_id
    reader = (batch_id, endpoint, config, window_s, (owner, top_priority))  # read_chunk's first arguments
    try:
        if (yield from _read(batch_id, owner, lines, reader, config.store_ttl_s, holder)):
            yield from progress.submit_jobs(batch_id, owner, holder)
    except LeaseLost:  # this call stalled past its lease, and the batch was taken over: it is the taker's now
        log.warning("batch %s: its creator lost its lease; another process moves it on", batch_id)
    finally:
        cpu_process.post(forget_reader, batch_id)
    return batch_id


def _request_lines(config: ServeConfig, input_file_id: str, owner: str | None) -> Flow:
    """The file's request lines: 404 when it is gone, 400 past max_batch_lines (nothing stored yet)."""
    text = yield from files.content(input_file_id, owner)
    if text is None:
        raise not_found(f"No file with id {input_file_id!r} (it was deleted)", "input_file_id")
    lines = yield Offload(request_lines, (text,))
    if len(lines) > config.max_batch_lines:
        raise bad_request(f"the input file holds {len(lines)} requests; a batch may hold {config.max_batch_lines} "
                          "at most: split it", "input_file_id", "batch_too_large")
    return lines


def _reserve(batch_id: str, owner: str, cap: int, expires_at: int) -> Flow:
    """Count the batch among its key's unended batches, or 429 when it has `cap` of them. A batch that ended
    without leaving them (its process died between the two writes) is found and dropped first."""
    budget = ApiKeyKeys(owner).batches
    for attempt in range(2):
        r = yield from flows.run_call(calls.reserve(budget, batch_id, 1, cap, expires_at, time.time()))
        if r.ok:
            return
        if attempt == 0:
            members = yield Cmd("zrange", (budget, 0, -1))
            ids = [calls.budget_item(m) for m in members]
            states = yield Pipe([Cmd("hget", (BatchKeys.batch(i), "status")) for i in ids])
            gone = [m for m, s in zip(members, states, strict=True) if s is None or s in batch_store.FINAL]
            if gone:
                yield Cmd("zrem", (budget, *gone))
    raise APIError(429, f"this key has {cap} batches that have not ended, its limit; retry when one has",
                   "rate_limit_exceeded", code="key_batches_full")


def _store(batch_id: str, fields: dict, owner: str | None, ttl: int, holder: Holder) -> Flow:
    """The batch's hash (the owner in the same HSET: no moment shows the batch without it) and its listings;
    this call holds its submitting lease."""
    key, now = BatchKeys.batch(batch_id), fields["created_at"]
    ops = [holder.claim(BatchKeys.submitting(batch_id)), Cmd("hset", (key,), {"mapping": fields}),
           Cmd("expire", (key, ttl))]
    for index in (BatchKeys.batches, *([BatchKeys.batches_of(owner)] if owner else [])):
        ops += [Cmd("zadd", (index, {batch_id: now})), Cmd("zremrangebyscore", (index, 0, now - ttl))]
    if fields["status"] == VALIDATING:
        ops.append(Cmd("sadd", (BatchKeys.active, batch_id)))
    _raise_first((yield Pipe(ops)))


def _read(batch_id: str, owner: str | None, lines: list[str], reader: tuple, ttl: int, holder: Holder) -> Flow:
    """Read the lines into items, a chunk at a time off the event loop, and store them; then mark the batch's
    lines all read. Returns False when reading failed (the batch failed with the reason)."""
    items, open_ = BatchKeys.items(batch_id), BatchKeys.open(batch_id)
    queues: set[str] = set()
    errors = 0
    for s in range(0, len(lines), READ_CHUNK):
        chunk = yield Offload(_caught, (cpu_process.call, read_chunk, *reader, lines[s:s + READ_CHUNK], s))
        if isinstance(chunk, Exception):
            log.error("batch %s: reading line %d on failed", batch_id, s, exc_info=chunk)
            yield from batch_store.fail(batch_id, owner, (VALIDATING,),
                                        "validation_failed", f"reading the batch's lines failed at line {s} or "
                                        f"after: {type(chunk).__name__}: {chunk}")
            yield from holder.give_up(BatchKeys.submitting(batch_id))
            return False
        ops = [Cmd("hset", (items,), {"mapping": chunk.items}), Cmd("expire", (items, ttl))]
        if chunk.jobs:
            ops += [Cmd("sadd", (open_, *chunk.jobs)), Cmd("expire", (open_, ttl))]
        _raise_first((yield Pipe(ops)))
        queues |= chunk.queues
        errors += chunk.errors
        yield from holder.keep(BatchKeys.submitting(batch_id))
    yield Cmd("hset", (BatchKeys.batch(batch_id),), {"mapping": {"line_errors": errors, VALIDATED: 1,
                                                                  QUEUES: json.dumps(sorted(queues))}})
    return True


def _caught(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or the exception it raised, as the value."""
    try:
        return fn(*args)
    except Exception as e:
        return e


def _raise_first(replies: list) -> None:
    for r in replies:
        if isinstance(r, Exception):
            raise r
