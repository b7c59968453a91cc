"""The Batch API's batches, kept in Redis (producer.keys.BatchKeys), never only in one process's memory: any
number of `serve` processes and the `pagedq batch` CLI share them, and any of them may die mid-batch.

A batch is a hash of its fields, a hash of its items (one per input line), a set of the lines whose jobs are
still open and one set per outcome. Creating one stores all of that before submitting a single job, and the
jobs' ids are fixed by the batch id and line number; so a process that finds a batch stuck in `validating`
(its creator died) submits its jobs again and no job runs twice. Reading a batch back and changing its status
are serve.batch_store's; what happens after creation is in serve.progress. Sans-IO flows (producer.flows): the
asyncio server and the sync CLI run the same code.
"""

from __future__ import annotations

import json
import time
import uuid

from producer.flows import Cmd, Flow, Pipe
from producer.keys import BatchKeys
from serve import batch_store, files, progress
from serve.batch_lines import read_items
from serve.batch_store import CANCELLING, FAILED, IN_PROGRESS, VALIDATING, WRITE_CHUNK
from serve.config import ServeConfig
from serve.errors import APIError, bad_request, not_found
from serve.tenancy import Tally
from serve.translate import ENDPOINTS, endpoint_kind

WINDOWS = {"24h": 24 * 3600}


def new_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def create(config: ServeConfig, input_file_id: str, endpoint: str, completion_window: str = "24h",
           metadata: dict | None = None, owner: str | None = None) -> Flow:
    """Create a batch from an uploaded file (of key id `owner`, which then owns the batch and its jobs) and submit
    its jobs; returns the batch object."""
    if endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint {endpoint!r} is not supported; pagedq runs {', '.join(ENDPOINTS)}", "endpoint")
    if completion_window not in WINDOWS:
        raise bad_request(f"completion_window must be one of {', '.join(WINDOWS)}", "completion_window")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or
                                 not all(isinstance(v, str) for v in metadata.values())):
        raise bad_request("metadata must be at most 16 string values", "metadata")
    meta = yield from files.get(_checked(input_file_id, "input_file_id"), owner)
    if meta is None:
        raise not_found(f"No file with id {input_file_id!r}", "input_file_id")
    if meta["purpose"] != "batch":
        raise bad_request(f"file {input_file_id} has purpose {meta['purpose']!r}; a batch needs 'batch'",
                          "input_file_id")
    text = yield from files.content(input_file_id, owner)
    batch_id = new_id()
    now = int(time.time())
    window = WINDOWS[completion_window]
    items = read_items(text or "", endpoint, endpoint_kind(endpoint), batch_id, config, window)
    fields = {"id": batch_id, "endpoint": endpoint, "input_file_id": input_file_id,
              "completion_window": completion_window, "created_at": now, "expires_at": now + window,
              "metadata": json.dumps(metadata or {}), "total": len(items),
              "line_errors": sum(it.request is None for it in items), "status": VALIDATING, "ttl": config.store_ttl_s}
    if owner:
        fields[files.OWNER] = owner  # in the same HSET as the rest: no moment shows the batch without it
    if not items:
        fields.update(status=FAILED, failed_at=now,
                      errors=json.dumps([{"code": "empty_file", "message": "the input file holds no request"}]))
    ttl = config.store_ttl_s
    key = BatchKeys.batch(batch_id)
    ops = [Cmd("set", (BatchKeys.submitting(batch_id), "creator"), {"px": batch_store.SUBMIT_LEASE_MS})]
    for s in range(0, len(items), WRITE_CHUNK):
        ops.append(Cmd("hset", (BatchKeys.items(batch_id),),
                       {"mapping": {str(i): it.to_json() for i, it in enumerate(items[s:s + WRITE_CHUNK], s)}}))
    jobs = [str(i) for i, it in enumerate(items) if it.request is not None]
    for s in range(0, len(jobs), WRITE_CHUNK):
        ops.append(Cmd("sadd", (BatchKeys.open(batch_id), *jobs[s:s + WRITE_CHUNK])))
    # The batch hash last: a batch that can be read has all its items.
    ops += [Cmd("hset", (key,), {"mapping": fields}),
            *(Cmd("expire", (k, ttl)) for k in (key, BatchKeys.items(batch_id), BatchKeys.open(batch_id))),
            *(c for index in (BatchKeys.batches, *([BatchKeys.batches_of(owner)] if owner else []))
              for c in (Cmd("zadd", (index, {batch_id: now})), Cmd("zremrangebyscore", (index, 0, now - ttl))))]
    if items:
        ops.append(Cmd("sadd", (BatchKeys.active, batch_id)))
    _raise_first((yield Pipe(ops)))
    if items:
        yield from progress.submit_jobs(batch_id, items, owner)
    return (yield from get(batch_id, owner))


def _find(batch_id: str, owner: str | None) -> Flow:
    """404 unless the batch exists and is there for key id `owner` (another key's batch is not found either)."""
    key = BatchKeys.batch(_checked(batch_id, "batch_id"))
    stored, exists = yield Pipe([Cmd("hget", (key, files.OWNER)), Cmd("exists", (key,))])
    if not exists or not files.visible(stored, owner):
        raise not_found(f"No batch with id {batch_id!r}")


def cancel(batch_id: str, owner: str | None = None, tally: Tally | None = None) -> Flow:
    """POST /v1/batches/{id}/cancel: the batch goes to cancelling, then cancelled once its jobs ended."""
    yield from _find(batch_id, owner)
    moved = yield from batch_store.set_status_if(batch_id, (VALIDATING, IN_PROGRESS), status=CANCELLING,
                                                 cancelling_at=int(time.time()))
    if moved:
        yield from progress.cancel_open(batch_id)
    return (yield from progress.advance(batch_id, tally))


def get(batch_id: str, owner: str | None = None, tally: Tally | None = None) -> Flow:
    """The batch object, advanced first (serve.progress): its counts and status are those of its jobs now."""
    yield from _find(batch_id, owner)
    out = yield from progress.advance(batch_id, tally)
    if out is None:
        raise not_found(f"No batch with id {batch_id!r}")
    return out


def listing(limit: int = 20, after: str | None = None, owner: str | None = None) -> Flow:
    """GET /v1/batches: newest first (those of key id `owner`, if given), `after` a batch id of the previous
    page."""
    index = BatchKeys.batches if owner is None else BatchKeys.batches_of(owner)
    start = 0
    if after:
        rank = yield Cmd("zrevrank", (index, _checked(after, "after")))
        start = 0 if rank is None else rank + 1
    ids = yield Cmd("zrevrange", (index, start, start + limit))
    more = len(ids) > limit
    ids = ids[:limit]
    rendered = []
    for i in ids:
        b = yield from batch_store.read(i)
        if b is not None:
            rendered.append(b)
    return {"object": "list", "data": rendered, "first_id": rendered[0]["id"] if rendered else None,
            "last_id": rendered[-1]["id"] if rendered else None, "has_more": more}


def _checked(value: str, param: str) -> str:
    try:
        BatchKeys.batch(value) if param in ("batch_id", "after") else BatchKeys.file(value)
    except ValueError as e:
        raise APIError(404 if param == "batch_id" else 400, str(e), param=param) from None
    return value


def _raise_first(replies: list) -> None:
    for r in replies:
        if isinstance(r, Exception):
            raise r
