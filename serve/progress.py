"""Advancing a batch: nothing in pagedq waits on a batch, so whoever looks at one moves it on. A read of the
batch (HTTP or CLI), `pagedq batch wait`, and each serve process's sweeper (every second, over the set of
unfinished batches) all run `advance`, which is idempotent and safe to run in many processes at once:

- validating, its creator gone (its submit lease lapsed): submit its jobs again (same ids: no job twice);
- in_progress / cancelling: read the states of its open jobs; each ended one moves from the open set to its
  outcome's set (SADD/SREM: recording a job twice counts it once); past the completion window, cancel the rest;
- no open job left: write the output and error files under ids fixed by the batch id (two finalizers write the
  same bytes), then set the final status, only from a non-final one (producer/scripts/set_if.lua).
"""

from __future__ import annotations

import time

from producer import wire
from producer.flows import Cmd, Flow, Pipe
from producer.keys import BatchKeys, Keys
from producer.protocol import JobResult
from serve import batches, files
from serve.batch_lines import output_line
from serve.translate import endpoint_kind

CHUNK = 1000
_OUTCOME = {wire.COMPLETED: "completed", wire.FAILED: "failed", wire.EXPIRED: "failed",
            wire.CANCELLED: "cancelled"}


def advance(batch_id: str) -> Flow:
    """Move the batch on as far as its jobs allow; returns its object (None: no such batch)."""
    h = yield Cmd("hgetall", (BatchKeys.batch(batch_id),))
    if not h:
        return None
    status = h["status"]
    if status == "validating":
        yield from _resume(batch_id)
    elif status in ("in_progress", "cancelling"):
        late = status == "in_progress" and time.time() > int(h["expires_at"])
        if late and (yield from batches.set_if(batch_id, ("in_progress",), status="cancelling", expiring=1,
                                          cancelling_at=int(time.time()))):
            yield from batches.cancel_open(batch_id)
        if not (yield from _record(batch_id)):
            yield from _finalize(batch_id)
    else:
        yield Cmd("srem", (BatchKeys.active, batch_id))
    return (yield from batches.read(batch_id))


def _resume(batch_id: str) -> Flow:
    """A batch still validating: its creator submits its jobs now, or died doing so. Take over only once its
    lease lapsed (SET NX), and submit again."""
    if not (yield Cmd("set", (BatchKeys.submitting(batch_id), "resumer"),
                      {"nx": True, "px": batches.SUBMIT_LEASE_MS})):
        return
    items = yield from batches.load_items(batch_id)
    yield from batches.submit(batch_id, [items[i] for i in sorted(items)])


def _state(reply_state: str | None, raw_result: str | None) -> str | None:
    if reply_state:
        return reply_state
    if raw_result:
        return JobResult.model_validate_json(raw_result).status
    return None


def _record(batch_id: str) -> Flow:
    """Move the open jobs that ended to their outcome's set; returns how many are still open."""
    open_ = sorted((yield Cmd("smembers", (BatchKeys.open(batch_id),))), key=int)
    for s in range(0, len(open_), CHUNK):
        items = yield from batches.load_items(batch_id, open_[s:s + CHUNK])
        jobs = [(i, Keys(it.queue), it.request.id) for i, it in items.items()]
        replies = yield Pipe([c for _, k, j in jobs for c in (Cmd("hget", (k.job(j), wire.F_STATE)),
                                                               Cmd("get", (k.result(j),)))])
        ops = []
        for n, (i, _, _) in enumerate(jobs):
            state = _state(replies[2 * n], replies[2 * n + 1])
            # No job and no result: its keys expired unseen (no process looked for longer than the result TTL).
            outcome = _OUTCOME.get(state, "failed" if state is None else None)
            if outcome is not None:
                ops += [Cmd("sadd", (BatchKeys.ended(batch_id, outcome), i)),
                        Cmd("srem", (BatchKeys.open(batch_id), i))]
        if ops:
            yield Pipe(ops)
    return (yield Cmd("scard", (BatchKeys.open(batch_id),)))


def _finalize(batch_id: str) -> Flow:
    h = yield Cmd("hgetall", (BatchKeys.batch(batch_id),))
    if h.get("status") not in ("in_progress", "cancelling"):
        return
    yield from batches.set_if(batch_id, ("in_progress", "cancelling"), finalizing_at=int(time.time()))
    kind = endpoint_kind(h["endpoint"])
    items = yield from batches.load_items(batch_id)
    order = sorted(items)
    results: dict[int, JobResult | None] = {}
    for s in range(0, len(order), CHUNK):
        part = [i for i in order[s:s + CHUNK] if items[i].request is not None]
        raws = (yield Pipe([Cmd("get", (Keys(items[i].queue).result(items[i].request.id),)) for i in part])) \
            if part else []
        for i, raw in zip(part, raws):
            results[i] = JobResult.model_validate_json(raw) if isinstance(raw, str) else None
    good, bad = [], []
    for i in order:
        ok, line = output_line(items[i], f"{batch_id}-{i}", kind, results.get(i))
        (good if ok else bad).append(line)
    ttl = int(h.get("ttl") or 0) or 7 * 24 * 3600
    out_id = err_id = ""
    if good:
        out_id = f"file-{batch_id}-output"
        yield from files.put("\n".join(good) + "\n", f"{batch_id}_output.jsonl", "batch_output", ttl, out_id)
    if bad:
        err_id = f"file-{batch_id}-errors"
        yield from files.put("\n".join(bad) + "\n", f"{batch_id}_errors.jsonl", "batch_output", ttl, err_id)
    now = int(time.time())
    if h["status"] == "in_progress":
        final = {"status": "completed", "completed_at": now}
    elif h.get("expiring"):
        final = {"status": "expired", "expired_at": now}
    else:
        final = {"status": "cancelled", "cancelled_at": now}
    # From the status read above only: a cancel that came meanwhile is finalized on the next advance.
    if (yield from batches.set_if(batch_id, (h["status"],), output_file_id=out_id, error_file_id=err_id, **final)):
        yield Cmd("srem", (BatchKeys.active, batch_id))


def sweep() -> Flow:
    """Advance every unfinished batch once (each serve process runs this every second or so)."""
    ids = yield Cmd("smembers", (BatchKeys.active,))
    for batch_id in ids:
        try:
            yield from advance(batch_id)
        except ValueError:  # an id that makes no key: drop it
            yield Cmd("srem", (BatchKeys.active, batch_id))
    return len(ids)

