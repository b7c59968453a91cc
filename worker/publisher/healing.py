"""Healing after a failover: a writer's memory across its round trips of what a failover may have lost.

A promoted replica may lack the last tokens this worker wrote. The scripts then answer with a gap (publish: the
tokens the stream holds; complete: GAP) and, while the job is still this worker's, the chunks it sent from there
are sent again, in the same order, before anything later: the stream ends up as an undisturbed run's. Each job
keeps the chunks it sent (JobView.sent) for that. With durability "replicated" every round trip ends with WAIT;
a job's end that no replica confirmed is written again (complete and fail are idempotent) with the next round
trips until one does.

When no replica confirms at all (the one replica is gone, or a failover promoted the last one and the old
primary never came back), the ends are published anyway: the primary has them, so their results are readable,
and the worker's intake room is freed (holding it would stop the worker taking queued jobs: a whole fleet could
wait for a replica that never comes). Such ends are unreplicated: a failover now could lose them. Alone says so
loudly: a log line the moment confirmations stop, a reminder every REMIND_S, a line when they resume; the
worker's metrics and heartbeat say it too (worker.metrics, worker.heartbeat).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from producer import calls
from producer.errors import LeaseLost, StreamGap
from producer.keys import Keys
from worker.publisher.job_view import JobView

log = logging.getLogger("pagedq.worker")

HEAL_ROUNDS = 3  # round trips that send lost chunks again, per batch (one is enough unless failovers repeat)
CONFIRM_RETRY_S = 0.2  # replicated: how soon an unconfirmed end is written again when nothing else comes
# Ends written again until a replica confirms them: complete and fail find a job they ended before and write
# nothing (a release would be refused: the job is no longer this worker's, so it is not sent again).
_REWRITABLE = ("complete", "fail")
MAX_HELD = 512  # unconfirmed ends written again at most; older ones are let go (each costs a call per round trip)
REMIND_S = 60.0  # while no replica confirms: how often the log says so again


class End(NamedTuple):
    """A job's end as the writer sends it: its view, its final status (or "released") and the script call.
    again: written before, and sent again until a replica confirms it (its outcome was reported then)."""

    view: JobView
    status: str
    call: calls.Call
    again: bool = False


Run = Callable[[list[calls.Call]], tuple[list, bool]]  # one round trip -> (outcomes, whether replicas confirmed)


class Healer:
    """The chunks each job sent, sent again where a stream lost them; the ends no replica confirmed yet."""

    def __init__(self, keys: Keys, run: Run, on_resent: Callable[[int], None]) -> None:
        self.keys, self._run, self.on_resent = keys, run, on_resent
        self.unconfirmed: list[End] = []  # replicated: ends written, not yet confirmed by a replica

    @staticmethod
    def sent(view: JobView, chunk: calls.Chunk) -> None:
        """A token chunk is sent (not the last: that one rides with the result)."""
        if not view.sent or view.sent[-1].offset < chunk.offset:  # not when a failed flush is retried
            view.sent.append(chunk)

    def write(self, chunks: list[tuple[JobView, calls.Chunk]], ends: list[End]) -> tuple[list | None, list, bool]:
        """Write the chunks and the ends (unconfirmed ones again among them) in one round trip, and again what a
        failover lost (_heal). Returns the chunks' acks, the ends' outcomes, and whether the replicas durability
        asks for confirmed it all."""
        todo = ([calls.publish(self.keys, [c for _, c in chunks])] if chunks else []) + [e.call for e in ends]
        outs, confirmed = self._run(todo)
        acks = outs.pop(0) if chunks else None
        for _ in range(HEAL_ROUNDS):
            gaps = _gaps(chunks, acks, ends, outs)
            if not gaps:
                break
            confirmed = self._heal(gaps, chunks, acks, ends, outs) and confirmed
        return acks, outs, confirmed

    def hold(self, ends: list[End], outs: list, confirmed: bool) -> int:
        """After a write of `ends` (unconfirmed ones included): those to write again until a replica confirms them
        (none if confirmed) -> how many."""
        self.unconfirmed = [] if confirmed else [
            e._replace(again=True) for e, out in zip(ends, outs, strict=True)
            if e.call.script in _REWRITABLE and not isinstance(out, Exception)]
        return len(self.unconfirmed)

    def cap(self) -> int:
        """Let go of the oldest unconfirmed ends beyond MAX_HELD -> how many."""
        n = max(0, len(self.unconfirmed) - MAX_HELD)
        del self.unconfirmed[:n]
        return n

    def give_up(self) -> int:
        """Stopping: the ends still unconfirmed are let go -> how many."""
        n, self.unconfirmed = len(self.unconfirmed), []
        return n

    def _heal(self, gaps: dict[str, tuple[JobView, int]], chunks: list, acks: list | None, ends: list[End],
              outs: list) -> bool:
        """Send each gap's chunks again from where its stream stops, then the ends that met it; puts their
        replies in place of the gap replies in `acks` and `outs`. Returns whether replicas confirmed it."""
        resend: list[calls.Chunk] = []
        lost: set[str] = set()
        for job_id, (view, emitted) in gaps.items():
            again = [c for c in view.sent if c.offset >= emitted]
            if not again or again[0].offset != emitted:
                # The stream stops before this delivery's first chunk: it lost tokens an earlier delivery wrote,
                # which cannot be while it holds this delivery's lease (the start came after them).
                log.error("job %s: its stream holds %d tokens, before this delivery's: giving it up", job_id, emitted)
                lost.add(job_id)
                continue
            resend += again
            log.warning("job %s: its stream lost its last tokens (a failover?): writing %d again from token %d",
                        job_id, sum(c.count for c in again), emitted)
        redo = [i for i, (e, out) in enumerate(zip(ends, outs, strict=True))
                if isinstance(out, StreamGap) and e.view.job.id not in lost]
        todo = ([calls.publish(self.keys, resend)] if resend else []) + [ends[i].call for i in redo]
        if not todo:
            replies, confirmed = [], True
        else:
            replies, confirmed = self._run(todo)
            self.on_resent(sum(c.count for c in resend))
        latest: dict[str, object] = {}
        if resend:
            resent_acks = replies.pop(0)
            for c, ack in zip(resend, resent_acks if isinstance(resent_acks, list) else [], strict=False):
                latest[c.job_id] = ack
        if isinstance(acks, list):
            for k, ((view, _), ack) in enumerate(zip(chunks, acks, strict=True)):
                if isinstance(ack, calls.Gap) and view.job.id in gaps:
                    acks[k] = "lost" if view.job.id in lost else latest.get(view.job.id, ack)
        for i, out in zip(redo, replies, strict=True):
            outs[i] = out
        for i, (e, out) in enumerate(zip(ends, outs, strict=True)):
            if isinstance(out, StreamGap) and e.view.job.id in lost:
                outs[i] = LeaseLost(f"job {e.view.job.id}: its stream lost tokens this worker cannot send again")
        return confirmed


class Alone:
    """Whether replicas confirm this writer's round trips; logs the moment they stop, reminds, and says when they
    resume. `since`: when they stopped (monotonic), None while they confirm."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.since: float | None = None
        self.ends = 0  # job ends published while no replica confirmed (this spell)
        self.said = 0.0

    def note(self, confirmed: bool, ends: int, held: int) -> None:
        """After a round trip: whether replicas confirmed it, the new job ends it published, the ends held."""
        now = self.clock()
        if confirmed:
            if self.since is not None:
                log.warning("durability replicated: replicas confirm writes again after %.0f s; %d job ends were "
                            "published unreplicated meanwhile", now - self.since, self.ends)
            self.since, self.ends = None, 0
            return
        self.ends += ends
        if self.since is None:
            self.since = self.said = now
            log.error("durability replicated: no replica confirms writes: publishing job ends anyway (results are "
                      "readable, but only the primary has them: a failover now could lose them); the worker reports "
                      "unreplicated until a replica confirms again")
        elif now - self.said >= REMIND_S:
            self.said = now
            log.error("durability replicated: still no replica confirms writes after %.0f s: %d job ends published "
                      "unreplicated, %d written again until one does", now - self.since, self.ends, held)


def _gaps(chunks: list, acks, ends: list[End], outs: list) -> dict[str, tuple[JobView, int]]:
    """Jobs whose stream lacks tokens this worker wrote: job id -> (its view, the tokens the stream holds)."""
    gaps: dict[str, tuple[JobView, int]] = {}

    def add(view: JobView, emitted: int) -> None:
        known = gaps.get(view.job.id)
        gaps[view.job.id] = (view, emitted if known is None else min(known[1], emitted))

    if isinstance(acks, list):
        for (view, _), ack in zip(chunks, acks, strict=True):
            if isinstance(ack, calls.Gap):
                add(view, ack.emitted)
    for end, out in zip(ends, outs, strict=True):
        if isinstance(out, StreamGap):
            add(end.view, out.emitted)
    return gaps
