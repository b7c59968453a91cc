"""Moving a batch on: nothing in pagedq waits on a batch, so whoever looks at one moves it on. A read of the
batch (HTTP or CLI), `pagedq batch wait`, and each serve process's sweeper (every second, over the set of
unfinished batches) all run `advance`, which is idempotent and safe to run in many processes at once:

- validating: its creator submits its jobs (submit_jobs), then moves it to in_progress; if the creator is gone
  (its submit lease lapsed), whoever advances the batch submits them again (same ids: no job twice);
- in_progress / cancelling: read the states of its open jobs; each ended one moves from the open set to its
  outcome's set (SADD/SREM: recording a job twice counts it once); past the completion window, cancel the rest;
- no open job left: write the output and error files under ids fixed by the batch id (two finalizers write the
  same bytes), then set the final status, only from a non-final one (producer/scripts/set_if.lua).

A batch made with an API key names it as its owner: its jobs and its output files are that key's too, and the
process whose SREM moves a line's job out of the open set counts that job's usage for the key (serve.tenancy).
"""

from __future__ import annotations

import time

from producer import calls, defaults, flows, wire
from producer.calls import Owner
from producer.flows import Cmd, Flow, Pipe
from producer.keys import BatchKeys, Keys
from producer.protocol import JobResult
from serve import batch_store, files, tenancy
from serve.batch_lines import Item, output_line
from serve.batch_store import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FAILED,
    IN_PROGRESS,
    VALIDATING,
    WRITE_CHUNK,
)
from serve.config import STORE_TTL_S
from serve.translate import endpoint_kind

READ_CHUNK = 1000  # jobs whose state (or result) is read per round trip
# A job's final state -> its line's outcome: the set of line numbers (BatchKeys.ended) it joins.
_OUTCOME = {wire.COMPLETED: COMPLETED, wire.FAILED: FAILED, wire.EXPIRED: FAILED, wire.CANCELLED: CANCELLED}


def advance(batch_id: str, tally: tenancy.Tally | None = None) -> Flow:
    """Move the batch on as far as its jobs allow; returns its object (None: no such batch). `tally` hears of
    the usage this call counted for the batch's owner."""
    h = yield Cmd("hgetall", (BatchKeys.batch(batch_id),))
    if not h:
        return None
    status, owner = h["status"], h.get(files.OWNER) or None
    if status == VALIDATING:
        yield from _resume(batch_id, owner)
    elif status in (IN_PROGRESS, CANCELLING):
        late = status == IN_PROGRESS and time.time() > int(h["expires_at"])
        if late and (yield from batch_store.set_status_if(batch_id, (IN_PROGRESS,), status=CANCELLING, expiring=1,
                                                          cancelling_at=int(time.time()))):
            yield from cancel_open(batch_id)
        if not (yield from _record(batch_id, owner, tally)):
            yield from _finalize(batch_id)
    else:
        yield Cmd("srem", (BatchKeys.active, batch_id))
    return (yield from batch_store.read(batch_id))


def submit_jobs(batch_id: str, items: list[Item], owner: str | None = None) -> Flow:
    """Submit every job of the batch (again: a job that exists already is left as it is), each named as key id
    `owner`'s, then move it on to in_progress; if it was cancelled meanwhile, cancel what was just submitted."""
    reqs = [(it.queue, it.request) for it in items if it.request is not None]
    who = Owner(owner) if owner else None
    for s in range(0, len(reqs), WRITE_CHUNK):
        outs = yield from flows.run_calls([calls.submit(Keys(q), r, who) for q, r in reqs[s:s + WRITE_CHUNK]])
        for o in outs:
            if isinstance(o, Exception) and not isinstance(o, calls.DuplicateJobError):
                raise o
    moved = yield from batch_store.set_status_if(batch_id, (VALIDATING,), status=IN_PROGRESS,
                                                 in_progress_at=int(time.time()))
    yield Cmd("delete", (BatchKeys.submitting(batch_id),))
    if not moved and (yield Cmd("hget", (BatchKeys.batch(batch_id), "status"))) == CANCELLING:
        yield from cancel_open(batch_id)


def cancel_open(batch_id: str) -> Flow:
    """Cancel the jobs of the batch that have not ended (queued ones at once, running ones within a step)."""
    open_ = sorted((yield Cmd("smembers", (BatchKeys.open(batch_id),))), key=int)
    items = yield from batch_store.load_items(batch_id, open_)
    todo = [(Keys(it.queue), it.request.id) for it in items.values() if it.request is not None]
    for s in range(0, len(todo), WRITE_CHUNK):
        # Outcomes, not raised: a job that ended meanwhile, or whose keys expired, is nothing to cancel.
        yield from flows.run_calls([calls.cancel(k, j, defaults.RESULT_TTL_S) for k, j in todo[s:s + WRITE_CHUNK]])


def _resume(batch_id: str, owner: str | None) -> Flow:
    """A batch still validating: its creator submits its jobs now, or died doing so. Take over only once its
    lease lapsed (SET NX), and submit again."""
    if not (yield Cmd("set", (BatchKeys.submitting(batch_id), "resumer"),
                      {"nx": True, "px": batch_store.SUBMIT_LEASE_MS})):
        return
    items = yield from batch_store.load_items(batch_id)
    yield from submit_jobs(batch_id, [items[i] for i in sorted(items)], owner)


def _state(reply_state: str | None, raw_result: str | None) -> str | None:
    if reply_state:
        return reply_state
    if raw_result:
        return JobResult.model_validate_json(raw_result).status
    return None


def _record(batch_id: str, owner: str | None, tally: tenancy.Tally | None) -> Flow:
    """Move the open jobs that ended to their outcome's set, counting their usage for the batch's owner (the
    process whose SREM moved a job counts it); returns how many are still open."""
    open_ = sorted((yield Cmd("smembers", (BatchKeys.open(batch_id),))), key=int)
    for s in range(0, len(open_), READ_CHUNK):
        items = yield from batch_store.load_items(batch_id, open_[s:s + READ_CHUNK])
        jobs = [(i, Keys(it.queue), it.request.id) for i, it in items.items()]
        replies = yield Pipe([c for _, k, j in jobs for c in (Cmd("hget", (k.job(j), wire.F_STATE)),
                                                               Cmd("get", (k.result(j),)))])
        ops, raws = [], []
        for n, (i, _, _) in enumerate(jobs):
            state = _state(replies[2 * n], replies[2 * n + 1])
            # No job and no result: its keys expired unseen (no process looked for longer than the result TTL).
            outcome = _OUTCOME.get(state, FAILED if state is None else None)
            if outcome is not None:
                ops += [Cmd("sadd", (BatchKeys.ended(batch_id, outcome), i)),
                        Cmd("srem", (BatchKeys.open(batch_id), i))]
                raws.append(replies[2 * n + 1])
        if ops:
            moved = (yield Pipe(ops))[1::2]
            mine = [raw for raw, took in zip(raws, moved, strict=True) if took]
            if owner:
                yield from tenancy.count(owner, len(mine), tenancy.total_usage(mine), tally=tally)
    return (yield Cmd("scard", (BatchKeys.open(batch_id),)))


def _finalize(batch_id: str) -> Flow:
    h = yield Cmd("hgetall", (BatchKeys.batch(batch_id),))
    if h.get("status") not in (IN_PROGRESS, CANCELLING):
        return
    yield from batch_store.set_status_if(batch_id, (IN_PROGRESS, CANCELLING), finalizing_at=int(time.time()))
    kind = endpoint_kind(h["endpoint"])
    items = yield from batch_store.load_items(batch_id)
    order = sorted(items)
    results: dict[int, JobResult | None] = {}
    for s in range(0, len(order), READ_CHUNK):
        part = [i for i in order[s:s + READ_CHUNK] if items[i].request is not None]
        raws = (yield Pipe([Cmd("get", (Keys(items[i].queue).result(items[i].request.id),)) for i in part])) \
            if part else []
        for i, raw in zip(part, raws):
            results[i] = JobResult.model_validate_json(raw) if isinstance(raw, str) else None
    good, bad = [], []
    for i in order:
        ok, line = output_line(items[i], f"{batch_id}-{i}", kind, results.get(i))
        (good if ok else bad).append(line)
    ttl = int(h.get("ttl") or 0) or STORE_TTL_S
    owner = h.get(files.OWNER) or None  # the batch's key owns its output files
    out_id = err_id = ""
    if good:
        out_id = f"file-{batch_id}-output"
        yield from files.put("\n".join(good) + "\n", f"{batch_id}_output.jsonl", "batch_output", ttl, out_id, owner)
    if bad:
        err_id = f"file-{batch_id}-errors"
        yield from files.put("\n".join(bad) + "\n", f"{batch_id}_errors.jsonl", "batch_output", ttl, err_id, owner)
    now = int(time.time())
    final = COMPLETED if h["status"] == IN_PROGRESS else EXPIRED if h.get("expiring") else CANCELLED
    # From the status read above only: a cancel that came meanwhile is finalized on the next advance.
    if (yield from batch_store.set_status_if(batch_id, (h["status"],), output_file_id=out_id, error_file_id=err_id,
                                             status=final, **{f"{final}_at": now})):
        yield Cmd("srem", (BatchKeys.active, batch_id))


def sweep(tally: tenancy.Tally | None = None) -> Flow:
    """Advance every unfinished batch once (each serve process runs this every second or so)."""
    ids = yield Cmd("smembers", (BatchKeys.active,))
    for batch_id in ids:
        try:
            yield from advance(batch_id, tally)
        except ValueError:  # an id that makes no key: drop it
            yield Cmd("srem", (BatchKeys.active, batch_id))
    return len(ids)

