"""Moving a batch on: nothing in pagedq waits on a batch, so some process must move each one on, and one at a time
does: the holder of its sweeper lease (serve.batch_lease). Each serve process's sweeper takes the lease of every
unfinished batch it can, every second, and moves on those it holds; `pagedq batch wait` and `status` do the
same for a batch no server holds. Moving a batch on is idempotent, so a holder that stalled past its lease and
the one that took over meanwhile write the same things:

- validating: its creator validates its lines and submits its jobs (serve.batch_intake), holding the batch's
  submitting lease; once that lapses (the creator is gone), the holder submits its jobs again when its lines
  were all stored (same ids: no job twice), and fails the batch when they were not;
- in_progress / cancelling: read the states of its open jobs (their hashes only: a batch's items, the requests,
  are read once to submit its jobs and once to write its output); each ended one moves from the open set to its
  outcome's set (SADD/SREM: recording a job twice counts it once); past the completion window, cancel the rest;
- no open job left: write the output and error files in parts (serve.files.Writer) under ids fixed by the
  batch id, then set the final status, only from a non-final one (producer/scripts/set_if.lua).

A batch made with an API key names it as its owner: its jobs and its output files are that key's too, and the
process whose SREM moves a line's job out of the open set counts that job's usage for the key (serve.tenancy).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterable

from producer import calls, defaults, flows, wire
from producer.calls import Owner
from producer.flows import Cmd, Flow, Offload, Pipe
from producer.keys import BatchKeys, Keys
from producer.protocol import JobRequest
from serve import batch_store, files, tenancy
from serve.batch_lease import Holder, LeaseLost
from serve.batch_lines import Item, output_lines
from serve.batch_store import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FAILED,
    FINAL,
    IN_PROGRESS,
    QUEUES,
    VALIDATED,
    VALIDATING,
    WRITE_CHUNK,
)
from serve.config import STORE_TTL_S
from serve.lanes import BATCH
from serve.translate import endpoint_kind

log = logging.getLogger("pagedq.serve")
SUBMIT_WITHIN_S = 3600  # a batch still validating this long after its creation is failed (never stuck there)
READ_CHUNK = 1000  # lines whose job state (or result, or item) is read per round trip
# A job's final state -> its line's outcome: the set of line numbers (BatchKeys.ended) it joins.
_OUTCOME = {wire.COMPLETED: COMPLETED, wire.FAILED: FAILED, wire.EXPIRED: FAILED, wire.CANCELLED: CANCELLED}


def sweep(holder: Holder, tally: tenancy.Tally | None = None) -> Flow:
    """Move on every unfinished batch whose lease `holder` holds or can take; returns how many it holds."""
    leases = {}
    for batch_id in (yield Cmd("smembers", (BatchKeys.active,))):
        try:
            leases[BatchKeys.sweeper(batch_id)] = batch_id
        except ValueError:  # an id that makes no key: drop it
            yield Cmd("srem", (BatchKeys.active, batch_id))
    mine = yield from holder.take(leases)
    for key in mine:
        try:
            yield from move(leases[key], holder, tally)
        except LeaseLost:  # it stalled past its lease: the new holder goes on
            pass
        except Exception:  # one batch's trouble (or a moment without Redis) is no reason to leave the others
            log.warning("moving batch %s on failed; the next round tries again", leases[key], exc_info=True)
    return len(mine)


def advance(batch_id: str, holder: Holder, tally: tenancy.Tally | None = None) -> Flow:
    """Move the batch on if `holder` holds (or can take) its lease; returns its object (None: no such batch)."""
    if (yield from holder.take([BatchKeys.sweeper(batch_id)])):
        with contextlib.suppress(LeaseLost):
            yield from move(batch_id, holder, tally)
    return (yield from batch_store.read(batch_id))


def move(batch_id: str, holder: Holder, tally: tenancy.Tally | None = None) -> Flow:
    """Move the batch on as far as its jobs allow (its sweeper lease held). `tally` hears of the usage this call
    counted for the batch's owner."""
    h = yield Cmd("hgetall", (BatchKeys.batch(batch_id),))
    if not h:  # expired
        yield Cmd("srem", (BatchKeys.active, batch_id))
        yield from holder.give_up(BatchKeys.sweeper(batch_id))
        return
    status, owner = h["status"], h.get(files.OWNER) or None
    if status == VALIDATING:
        yield from _resume(batch_id, h, owner, holder)
    elif status in (IN_PROGRESS, CANCELLING):
        late = status == IN_PROGRESS and time.time() > int(h["expires_at"])
        if late and (yield from batch_store.set_status_if(batch_id, (IN_PROGRESS,), status=CANCELLING, expiring=1,
                                                          cancelling_at=int(time.time()))):
            yield from cancel_open(batch_id)
        if not (yield from _record(batch_id, h, owner, tally, holder)):
            yield from _finalize(batch_id, owner, holder)
    if (yield Cmd("hget", (BatchKeys.batch(batch_id), "status"))) in FINAL:
        yield from batch_store.ended(batch_id, owner)
        yield from holder.give_up(BatchKeys.sweeper(batch_id))


def submit_jobs(batch_id: str, owner: str | None, holder: Holder) -> Flow:
    """Submit the jobs of the batch's open lines (again: a job that exists already is left as it is), each named
    as key id `owner`'s, holding its submitting lease; then move it on to in_progress, and if it was cancelled
    meanwhile, cancel what was just submitted."""
    lease = BatchKeys.submitting(batch_id)
    open_ = sorted((yield Cmd("smembers", (BatchKeys.open(batch_id),))), key=int)
    for s in range(0, len(open_), WRITE_CHUNK):
        raw = yield Cmd("hmget", (BatchKeys.items(batch_id), open_[s:s + WRITE_CHUNK]))
        todo = yield Offload(_submits, (raw, owner))
        for out in (yield from flows.run_calls(todo)):
            if isinstance(out, Exception) and not isinstance(out, calls.DuplicateJobError):
                raise out
        yield from holder.keep(lease)
    moved = yield from batch_store.set_status_if(batch_id, (VALIDATING,), status=IN_PROGRESS,
                                                 in_progress_at=int(time.time()))
    yield from holder.give_up(lease)
    if not moved and (yield Cmd("hget", (BatchKeys.batch(batch_id), "status"))) == CANCELLING:
        yield from cancel_open(batch_id)


def _submits(raw_items: list[str | None], owner: str | None) -> list[calls.Call]:
    who = Owner(owner) if owner else None
    items = [Item.from_json(r) for r in raw_items if r]
    return [calls.submit(Keys(it.queue), _on_batch_lane(it.request, owner), who) for it in items
            if it.request is not None]


def _on_batch_lane(req: JobRequest, owner: str | None) -> JobRequest:
    """A line's job as its item holds it: in the batch lane, the owner's group (serve.lanes). An item stored before
    items named a lane is put there now."""
    if req.lane == BATCH:
        return req
    return req.model_copy(update={"lane": BATCH, "group": owner})


def cancel_open(batch_id: str) -> Flow:
    """Cancel the jobs of the batch that have not ended (queued ones at once, running ones within a step)."""
    queues = yield from _queues(batch_id)
    open_ = sorted((yield Cmd("smembers", (BatchKeys.open(batch_id),))), key=int)
    todo = [(Keys(q), f"{batch_id}-{i}") for i in open_ for q in queues]
    for s in range(0, len(todo), WRITE_CHUNK):
        # Outcomes, not raised: a job that ended meanwhile, whose keys expired or that lives on another of the
        # batch's queues, is nothing to cancel.
        yield from flows.run_calls([calls.cancel(k, j, defaults.RESULT_TTL_S) for k, j in todo[s:s + WRITE_CHUNK]])


def _queues(batch_id: str) -> Flow:
    """The queues the batch's jobs run on: none before its lines were all read (no job was submitted). A batch
    stored before they were recorded: read from its items once."""
    queues, validated = yield Cmd("hmget", (BatchKeys.batch(batch_id), [QUEUES, VALIDATED]))
    if queues is not None:
        return json.loads(queues)
    if not validated:
        return []
    raw = yield Cmd("hvals", (BatchKeys.items(batch_id),))
    queues = sorted({json.loads(r).get("queue") for r in raw} - {None})
    yield Cmd("hset", (BatchKeys.batch(batch_id), QUEUES, json.dumps(queues)))
    return queues


def _resume(batch_id: str, h: dict, owner: str | None, holder: Holder) -> Flow:
    """A batch still validating: its creator is at it, or died. Take over only once its lease lapsed: submit its
    jobs, or fail it when its lines were not all read, or its jobs could not be submitted for too long."""
    lease = BatchKeys.submitting(batch_id)
    if not (yield from holder.take([lease])):
        return
    late = time.time() > int(h["created_at"]) + SUBMIT_WITHIN_S
    if h.get(VALIDATED) and not late:
        yield from submit_jobs(batch_id, owner, holder)
        return
    if h.get(VALIDATED):
        code, why = "submission_failed", f"its jobs could not be submitted within {SUBMIT_WITHIN_S} s of its creation"
    else:
        code, why = "validation_interrupted", "the process that read its lines stopped before it had read them all"
    yield from batch_store.fail(batch_id, owner, (VALIDATING,), code, f"{why}; create the batch again")
    yield from cancel_open(batch_id)  # what was submitted of it
    yield from holder.give_up(lease)


def _record(batch_id: str, h: dict, owner: str | None, tally: tenancy.Tally | None, holder: Holder) -> Flow:
    """Move the open jobs that ended to their outcome's set, counting their usage for the batch's owner (the
    process whose SREM moved a job counts it); returns how many are still open."""
    queues = yield from _queues(batch_id)
    open_ = sorted((yield Cmd("smembers", (BatchKeys.open(batch_id),))), key=int)
    for s in range(0, len(open_), READ_CHUNK):
        lines = open_[s:s + READ_CHUNK]
        # A line's job lives on one of the batch's queues (nearly always one): its state is found on that one.
        states = yield from _each(Cmd("hget", (Keys(q).job(f"{batch_id}-{i}"), wire.F_STATE)) for i in lines
                                  for q in queues)
        ended = []
        for n, i in enumerate(lines):
            found = [(q, st) for q, st in zip(queues, states[n * len(queues):(n + 1) * len(queues)]) if st]
            queue, state = found[0] if found else (None, None)
            # No job: its keys expired unseen (no process looked for longer than the result TTL).
            outcome = FAILED if state is None else _OUTCOME.get(state)
            if outcome is not None:
                ended.append((i, queue, outcome))
        if ended:
            yield from _ended(batch_id, owner, ended, tally)
        yield from holder.keep(BatchKeys.sweeper(batch_id))
    return (yield Cmd("scard", (BatchKeys.open(batch_id),)))


def _ended(batch_id: str, owner: str | None, ended: list[tuple[str, str | None, str]],
           tally: tenancy.Tally | None) -> Flow:
    ops = [c for i, _, outcome in ended for c in (Cmd("sadd", (BatchKeys.ended(batch_id, outcome), i)),
                                                   Cmd("srem", (BatchKeys.open(batch_id), i)))]
    moved = (yield Pipe(ops))[1::2]
    mine = [(i, queue) for (i, queue, _), took in zip(ended, moved, strict=True) if took]
    if owner and mine:
        raws = yield from _each(Cmd("get", (Keys(q).result(f"{batch_id}-{i}"),)) for i, q in mine if q)
        yield from tenancy.count(owner, len(mine), tenancy.total_usage(raws), tally=tally)


def _finalize(batch_id: str, owner: str | None, holder: Holder) -> Flow:
    h = yield Cmd("hgetall", (BatchKeys.batch(batch_id),))
    if h.get("status") not in (IN_PROGRESS, CANCELLING):
        return
    yield from batch_store.set_status_if(batch_id, (IN_PROGRESS, CANCELLING), finalizing_at=int(time.time()))
    kind = endpoint_kind(h["endpoint"])
    queues = yield from _queues(batch_id)
    ttl = int(h.get("ttl") or 0) or STORE_TTL_S
    # The batch's key owns its output files.
    out = files.Writer(f"file-{batch_id}-output", f"{batch_id}_output.jsonl", "batch_output", ttl, owner)
    err = files.Writer(f"file-{batch_id}-errors", f"{batch_id}_errors.jsonl", "batch_output", ttl, owner)
    total = int(h["total"])
    for s in range(0, total, READ_CHUNK):
        lines = range(s, min(total, s + READ_CHUNK))
        raw_items = yield Cmd("hmget", (BatchKeys.items(batch_id), [str(i) for i in lines]))
        found = yield from _each(Cmd("get", (Keys(q).result(f"{batch_id}-{i}"),)) for i in lines for q in queues)
        results = [next((r for r in found[n * len(queues):(n + 1) * len(queues)] if r), None)
                   for n in range(len(lines))]
        good, bad = yield Offload(output_lines, (batch_id, kind, s, raw_items, results))
        yield from out.write(good)
        yield from err.write(bad)
        yield from holder.keep(BatchKeys.sweeper(batch_id))
    out_file = yield from out.close()
    err_file = yield from err.close()
    final = COMPLETED if h["status"] == IN_PROGRESS else EXPIRED if h.get("expiring") else CANCELLED
    # From the status read above only: a cancel that came meanwhile is finalized on the next move.
    yield from batch_store.set_status_if(batch_id, (h["status"],), status=final, **{f"{final}_at": int(time.time())},
                                         output_file_id=out_file["id"] if out_file else "",
                                         error_file_id=err_file["id"] if err_file else "")


def _each(cmds: Iterable[Cmd]) -> Flow:
    """The replies of `cmds`, sent in one round trip (none for none)."""
    cmds = list(cmds)
    return (yield Pipe(cmds)) if cmds else []
