"""The writer: a thread of the publisher process that writes a worker's outputs to Redis, one pipelined round
trip per batch of them. The process hands it each step's outputs (StepOutput) and the jobs that end otherwise;
JSON encoding and the network happen here. Whatever piled up while a round trip was in flight goes out together
in the next one. What a failover may lose on the way (tokens a promoted replica lacks, ends no replica
confirmed) is the healing module's to write again. With durability replicated a job's end is published (and
frees the worker's intake room) whether or not a replica confirmed it; healing.Alone says loudly when none does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

import redis as redis_lib

from producer import calls, wire
from producer.durability import ASYNC_DURABILITY, Durability
from producer.errors import LeaseLost, NotReplicated
from producer.keys import Keys
from producer.protocol import ErrorInfo, TokenLogprob
from worker.pipeline import run_calls
from worker.publisher.healing import CONFIRM_RETRY_S, Alone, End, Healer
from worker.publisher.job_view import FINISH, JobView, StepOutput

log = logging.getLogger("pagedq.worker")

_STOP = object()
LAST_CHANCE_S = 5.0  # stopping with ends no replica confirmed: how long they are written again before letting go


# The writer's inbox, in order: steps, jobs that end otherwise, marks.

class _Step(NamedTuple):
    outputs: list[StepOutput]  # finished ones end their job
    now: float


class _JobEnd(NamedTuple):
    """A job the engine no longer runs: kind "end" (with its final status), "fail" or "release" (with its mode)."""

    view: JobView
    kind: str
    status: str  # end: the final status; release: the mode; fail: "failed"
    finish_reason: str | None  # end only
    error: ErrorInfo | None  # the result's error (release: the reason given to the queue)
    at: float


class _Mark(NamedTuple):
    n: int  # on_flushed(n) once everything before it is written


class WriterMetrics(Protocol):
    """What the writer reports: worker.metrics.Metrics implements it; in the publisher process each call goes up
    the pipe to the worker's Metrics (process.RelayedMetrics)."""

    def publish_round_trip(self, seconds: float) -> None: ...

    def lease_lost(self) -> None: ...

    def job_done(self, status: str) -> None: ...

    def dead_letter(self) -> None: ...

    def not_replicated(self) -> None: ...

    def resent(self, tokens: int) -> None: ...


RELAYED = tuple(name for name in vars(WriterMetrics) if not name.startswith("_"))  # its calls, by name


class Notices(Protocol):
    def put(self, notice: tuple[str, str, str]) -> None:
        """("cancel" | "lost", job id, lease), learned from the replies to token writes."""


class RedisWriter(threading.Thread):
    def __init__(self, r: redis_lib.Redis, keys: Keys, settings: calls.WorkerSettings, model: str,
                 metrics: WriterMetrics, notices: Notices, on_settled: Callable[[int], None],
                 durability: Durability = ASYNC_DURABILITY, on_flushed: Callable[[int], None] | None = None) -> None:
        """on_settled(n): n finished jobs handed over are written (or given up on), so they no longer sit in the
        group's pending list: the worker's intake counts them until then. on_flushed(n): everything handed over
        before mark(n) is written (or given up on)."""
        super().__init__(name="pagedq-publisher", daemon=True)
        self.r, self.keys, self.settings = r, keys, settings
        self.worker_id, self.model, self.ttl, self.metrics = settings.worker_id, model, settings.ttl, metrics
        self.notices, self.on_settled, self.on_flushed = notices, on_settled, on_flushed
        self.durability = durability
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.give_up_at = float("inf")
        self.healer = Healer(keys, self._run, metrics.resent)
        self.alone = Alone()

    # ---- the process's side ---------------------------------------------------------------------------------

    def step(self, outputs: list[StepOutput], now: float) -> None:
        """One engine step's outputs; finished ones end their job."""
        self.inbox.put(_Step(outputs, now))

    def end(self, view: JobView, status: str, finish_reason: str, why: str = "") -> None:
        """End a job the engine no longer runs (cancelled, expired, shut down) with its output so far; `why`, if
        given, is the result's error message (its type: the status)."""
        error = ErrorInfo(type=status, message=why) if why else None
        self.inbox.put(_JobEnd(view, "end", status, finish_reason, error, time.time()))

    def fail(self, view: JobView, type: str, message: str) -> None:
        self.inbox.put(_JobEnd(view, "fail", wire.FAILED, None, ErrorInfo(type=type, message=message), time.time()))

    def release(self, view: JobView, mode: str, type: str = "", message: str = "") -> None:
        """Give a job back to the queue: "handback" (draining) or "retry" (it failed; dead-lettered once it
        used up its attempts)."""
        error = ErrorInfo(type=type or mode, message=message or mode)
        self.inbox.put(_JobEnd(view, "release", mode, None, error, time.time()))

    def mark(self, n: int) -> None:
        """Call on_flushed(n) once everything handed over before this is written."""
        self.inbox.put(_Mark(n))

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop. Redis errors are retried until `timeout` runs out."""
        self.give_up_at = time.monotonic() + timeout
        self.inbox.put(_STOP)
        self.join(timeout + 1)

    # ---- the writer thread ----------------------------------------------------------------------------------

    def run(self) -> None:
        stop = False
        while not stop:
            try:  # unconfirmed ends are written again after a while even when nothing else comes
                batch = [self.inbox.get(timeout=CONFIRM_RETRY_S if self.healer.unconfirmed else None)]
            except queue.Empty:
                batch = []
            while True:
                try:
                    batch.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            if _STOP in batch:
                stop = True
                batch = [b for b in batch if b is not _STOP]
            marks = [op.n for op in batch if isinstance(op, _Mark)]
            if marks:
                batch = [op for op in batch if not isinstance(op, _Mark)]
            if batch or self.healer.unconfirmed:
                self._flush_until_written(batch)
            for n in marks:  # a mark came after everything in this batch: all of it is written now
                self.on_flushed(n)
        # Stopping: a last chance for a replica to confirm (the ends are published already: no long wait for one)
        until = min(self.give_up_at, time.monotonic() + LAST_CHANCE_S)
        while self.healer.unconfirmed and time.monotonic() < until:
            time.sleep(CONFIRM_RETRY_S)
            self._flush_until_written([])
        if self.healer.unconfirmed:  # published and settled already: only the replicas' copies are missing
            n = self.healer.give_up()
            log.error("publisher: %d job ends no replica confirmed; stopping anyway (the primary has them)", n)

    def _flush_until_written(self, batch: list) -> None:
        # Every write is fenced and idempotent, so retrying a batch whose reply was lost is safe; giving up
        # would lose a result, so retry until Redis is back (or the worker is told to quit).
        delay = 0.1
        while True:
            try:
                self.flush(batch)
                return
            except (redis_lib.ConnectionError, redis_lib.TimeoutError) as e:
                if time.monotonic() > self.give_up_at:
                    log.error("publisher: redis unreachable, %d items not written: %s", len(batch), e)
                    self._settle(batch)
                    return
                log.warning("publisher: redis unreachable (%s); retrying in %.1f s", e, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            except Exception:
                log.exception("publisher: could not write %d items to redis", len(batch))
                self._settle(batch)
                return

    def _settle(self, batch: list) -> None:
        # Items never written still count as pending acks: release them, or intake would stall.
        n = sum(1 for op in batch if isinstance(op, _JobEnd)) + sum(
            1 for op in batch if isinstance(op, _Step) for out in op.outputs if out.ends_job)
        self.on_settled(n)

    def flush(self, batch: list) -> None:
        chunks: list[tuple[JobView, calls.Chunk]] = []
        ends: list[End] = []
        for op in batch:
            if isinstance(op, _Step):
                self._step_calls(op.outputs, op.now, chunks, ends)
            else:
                ends.append(self._end_call(op))
        ends += self.healer.unconfirmed
        t = time.perf_counter()
        acks, outs, confirmed = self.healer.write(chunks, ends)
        self.metrics.publish_round_trip(time.perf_counter() - t)
        if not confirmed:  # written, but a failover now could lose them: the ends are written again meanwhile
            self.metrics.not_replicated()
        new = sum(1 for e in ends if not e.again)
        held = self.healer.hold(ends, outs, confirmed)
        dropped = self.healer.cap()
        if dropped:
            log.warning("publisher: %d unconfirmed job ends no longer written again (more than %d held)", dropped,
                        held - dropped)
        # Published, so settled: an end held back for a replica would hold the worker's intake room with it.
        self.on_settled(new)
        self.alone.note(confirmed, new, held - dropped)
        if chunks:
            self._read_acks([view for view, _ in chunks], acks)
        for end, out in zip(ends, outs, strict=True):
            if not end.again or (isinstance(out, Exception) and not isinstance(out, LeaseLost)):
                self._read_end(end.view, end.status, out)

    def _run(self, todo: list[calls.Call]) -> tuple[list, bool]:
        try:
            return run_calls(self.r, todo, durability=self.durability), True
        except NotReplicated as e:  # self.alone says so, once
            return e.outcomes, False

    def _step_calls(self, outputs: list[StepOutput], now: float, chunks: list, ends: list[End]) -> None:
        for out in outputs:
            view = out.view
            job = view.job
            chunk = None
            if out.token_ids or out.text:
                chunk = calls.Chunk(job.id, job.lease, out.offset, len(out.token_ids), self._token_event(out))
            if out.ends_job:
                # The last chunk rides with the result: a stream never holds all tokens but no end.
                res = view.result(wire.COMPLETED, self.worker_id, self.model, now, FINISH.get(out.finish_reason))
                ends.append(End(view, wire.COMPLETED, calls.complete(
                    self.keys, job.delivery, wire.COMPLETED, res.model_dump_json(), self.ttl, chunk, out.offset)))
            elif chunk:
                self.healer.sent(view, chunk)
                chunks.append((view, chunk))

    def _end_call(self, op: _JobEnd) -> End:
        view, err = op.view, op.error
        delivery = view.job.delivery
        if op.kind == "release":
            return End(view, "released", calls.release(self.keys, delivery, self.settings, op.status, err.type,
                                                       err.message))
        if op.kind == "end":
            res = view.result(op.status, self.worker_id, self.model, op.at, op.finish_reason, error=err)
            return End(view, op.status, calls.complete(self.keys, delivery, op.status, res.model_dump_json(),
                                                       self.ttl, tokens=view.emitted))
        res = view.result(wire.FAILED, self.worker_id, self.model, op.at, "error", error=err)
        return End(view, wire.FAILED, calls.fail(self.keys, delivery, res.model_dump_json(), self.ttl))

    def _read_acks(self, views: list[JobView], acks) -> None:
        if isinstance(acks, Exception):
            log.error("publish failed: %s", acks)
            return
        for view, ack in zip(views, acks, strict=True):
            job = view.job
            if ack == "lost":
                self.metrics.lease_lost()
                log.warning("job %s: lease lost: token write refused", job.id)
            if ack in ("lost", "cancel"):
                self.notices.put((ack, job.id, job.lease))

    def _read_end(self, view: JobView, status: str, out) -> None:
        job = view.job
        if isinstance(out, LeaseLost):
            self.metrics.lease_lost()
            log.warning("job %s: lease lost: %s refused", job.id, status)
        elif isinstance(out, Exception):
            log.error("job %s: could not write its result: %s", job.id, out)
        elif status != "released":
            self.metrics.job_done(status)
        elif out.outcome == "dead":
            log.warning("job %s: dead-lettered after %s attempts", job.id, out.attempts)
            self.metrics.dead_letter()
        else:
            log.info("job %s: handed back to the queue", job.id)

    def _token_event(self, out: StepOutput) -> str:
        lps = None
        if out.logprobs:
            lps = [TokenLogprob(token_id=t, logprob=lp, top=top)
                   for t, (lp, top) in zip(out.token_ids, out.logprobs, strict=False)]
            choice = out.choice
            if choice.logprobs is None:
                choice.logprobs = []
            choice.logprobs.extend(lps)
            lps = [x.model_dump() for x in lps]
        if not out.view.several:
            return wire.token_event(out.text, out.token_ids, lps)
        # Which continuation; where it ended, so that a resumed job does not go on with it.
        return wire.token_event(out.text, out.token_ids, lps, out.choice.index, FINISH.get(out.finish_reason))
