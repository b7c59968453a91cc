"""A batch as Redis keeps it (producer.keys.BatchKeys): its states, its hash read back as OpenAI's batch object,
its items, and the one way its status changes. serve.batches (the API's operations) and serve.progress (moving
a batch on) both build on it. Sans-IO flows (producer.flows): the asyncio server and the sync CLI run the same
code.
"""

from __future__ import annotations

import json
import time
import uuid

from producer import calls, flows
from producer.flows import Cmd, Flow, Pipe
from producer.keys import ApiKeyKeys, BatchKeys

# A batch's status, as OpenAI names them. FINALIZING is never stored: a batch reads as finalizing while it is
# in progress with its output files being written (see render).
VALIDATING = "validating"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
CANCELLING = "cancelling"
COMPLETED = "completed"
FAILED = "failed"
EXPIRED = "expired"
CANCELLED = "cancelled"
FINAL = (COMPLETED, FAILED, EXPIRED, CANCELLED)
TIMES = tuple(f"{s}_at" for s in (IN_PROGRESS, FINALIZING, COMPLETED, FAILED, EXPIRED, CANCELLING, CANCELLED))

WRITE_CHUNK = 500  # jobs submitted or cancelled per round trip
# Fields of a batch's hash beyond OpenAI's: its lines were all read into items; the queues its jobs run on (JSON).
VALIDATED = "validated"
QUEUES = "queues"


def new_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def set_status_if(batch_id: str, states: tuple[str, ...], **fields: object) -> Flow:
    """Set the batch's fields only while its status is one of `states` (producer/scripts/set_if.lua): two
    processes that advance one batch at once cannot move it backwards. Returns whether they were set."""
    return (yield from flows.run_call(calls.set_if(BatchKeys.batch(batch_id), "status", states, fields)))


def ended(batch_id: str, owner: str | None) -> Flow:
    """The batch is final: no sweeper looks at it any more, and it leaves its key's unended batches."""
    ops = [Cmd("srem", (BatchKeys.active, batch_id))]
    if owner:
        ops.append(Cmd("zrem", (ApiKeyKeys(owner).batches, calls.budget_member(batch_id, 1))))
    yield Pipe(ops)


def fail(batch_id: str, owner: str | None, states: tuple[str, ...], code: str, message: str) -> Flow:
    """Fail the batch as a whole (OpenAI's `errors`), if its status is one of `states`."""
    errors = json.dumps([{"code": code, "message": message, "param": None, "line": None}])
    if (yield from set_status_if(batch_id, states, status=FAILED, failed_at=int(time.time()), errors=errors)):
        yield from ended(batch_id, owner)


def read(batch_id: str) -> Flow:
    """The batch object as stored, with its live counts; None if there is no such batch."""
    h, done, failed = yield Pipe([Cmd("hgetall", (BatchKeys.batch(batch_id),)),
                                  Cmd("scard", (BatchKeys.ended(batch_id, COMPLETED),)),
                                  Cmd("scard", (BatchKeys.ended(batch_id, FAILED),))])
    if not h:
        return None
    return render(h, done, failed)


def render(h: dict, completed: int, failed: int) -> dict:
    out = {"id": h["id"], "object": "batch", "endpoint": h["endpoint"], "input_file_id": h["input_file_id"],
           "completion_window": h["completion_window"], "status": h["status"],
           "output_file_id": h.get("output_file_id") or None, "error_file_id": h.get("error_file_id") or None,
           "created_at": int(h["created_at"]), "expires_at": int(h["expires_at"]),
           "errors": {"object": "list", "data": json.loads(h["errors"])} if h.get("errors") else None,
           "request_counts": {"total": int(h["total"]), "completed": completed,
                              "failed": failed + int(h["line_errors"])},
           "metadata": json.loads(h.get("metadata") or "{}")}
    for t in TIMES:
        out[t] = int(h[t]) if h.get(t) else None
    if out["status"] == IN_PROGRESS and out["finalizing_at"]:
        out["status"] = FINALIZING  # its output files are being written
    return out
