"""The Batch API's operations on batches, kept in Redis (producer.keys.BatchKeys), never only in one process's
memory: any number of `serve` processes and the `pagedq batch` CLI share them, and any of them may die mid-batch.

A batch is a hash of its fields, a hash of its items (one per input line), a set of the lines whose jobs are
still open and one set per outcome. Creating one is serve.batch_intake's; reading a batch back and changing its
status are serve.batch_store's; moving it on is serve.progress's. Sans-IO flows (producer.flows): the asyncio
server and the sync CLI run the same code.
"""

from __future__ import annotations

import json
import time

from producer.flows import Cmd, Flow, Pipe
from producer.keys import BatchKeys
from serve import batch_intake, batch_store, files, progress
from serve.batch_lease import Holder
from serve.batch_store import CANCELLING, IN_PROGRESS, VALIDATING
from serve.config import ServeConfig
from serve.errors import APIError, bad_request, not_found
from serve.tenancy import Tally
from serve.translate import ENDPOINTS

WINDOWS = {"24h": 24 * 3600}


def create(config: ServeConfig, input_file_id: str, endpoint: str, completion_window: str = "24h",
           metadata: dict | None = None, owner: str | None = None, max_batches: int = 0,
           top_priority: int | None = None) -> Flow:
    """Create a batch from an uploaded file (of key id `owner`, which then owns the batch and its jobs, within its
    cap of `max_batches` unended batches: 0, none; its lines' priorities no more urgent than `top_priority`, None:
    any) and submit its jobs (in the batch lane, the owner's group); returns the batch object."""
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
    fields = {"completion_window": completion_window, "metadata": json.dumps(metadata or {})}
    batch_id = yield from batch_intake.create(config, input_file_id, endpoint, WINDOWS[completion_window], fields,
                                              owner, max_batches, top_priority)
    return (yield from show(batch_id, owner))


def _find(batch_id: str, owner: str | None) -> Flow:
    """404 unless the batch exists and is there for key id `owner` (another key's batch is not found either)."""
    key = BatchKeys.batch(_checked(batch_id, "batch_id"))
    stored, exists = yield Pipe([Cmd("hget", (key, files.OWNER)), Cmd("exists", (key,))])
    if not exists or not files.visible(stored, owner):
        raise not_found(f"No batch with id {batch_id!r}")


def cancel(batch_id: str, owner: str | None = None) -> Flow:
    """POST /v1/batches/{id}/cancel: the batch goes to cancelling, its jobs are cancelled, and it is cancelled
    once they ended (serve.progress)."""
    yield from _find(batch_id, owner)
    if (yield from batch_store.set_status_if(batch_id, (VALIDATING, IN_PROGRESS), status=CANCELLING,
                                             cancelling_at=int(time.time()))):
        yield from progress.cancel_open(batch_id)
    return (yield from show(batch_id, owner))


def show(batch_id: str, owner: str | None = None) -> Flow:
    """The batch object as it stands (its counts those the process that moves it on recorded last)."""
    yield from _find(batch_id, owner)
    out = yield from batch_store.read(batch_id)
    if out is None:
        raise not_found(f"No batch with id {batch_id!r}")
    return out


def get(batch_id: str, owner: str | None = None, tally: Tally | None = None, holder: Holder | None = None
        ) -> Flow:
    """The batch object, moved on first (serve.progress) unless another process holds it: by `holder`, which
    keeps its lease (`pagedq batch wait`), else by this call alone (`pagedq batch status`)."""
    yield from _find(batch_id, owner)
    once = holder is None
    holder = holder or Holder()
    out = yield from progress.advance(batch_id, holder, tally)
    if once:
        yield from holder.give_up(BatchKeys.sweeper(batch_id))
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

