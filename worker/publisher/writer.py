"""The writer: a thread of the publisher process that writes a worker's outputs to Redis, one pipelined round
trip per batch of them. The process hands it each step's outputs (StepOutput) and the jobs that end otherwise;
JSON encoding and the network happen here. Whatever piled up while a round trip was in flight goes out together
in the next one.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from json.encoder import encode_basestring
from typing import Protocol

import redis as redis_lib

from producer import calls, wire
from producer.errors import LeaseLost
from producer.keys import Keys
from producer.protocol import ErrorInfo, TokenLogprob
from worker.job import RunningJob
from worker.pipeline import run_calls
from worker.publisher.job_view import FINISH, JobView
from worker.publisher.messages import StepOutput

log = logging.getLogger("pagedq.worker")

_STOP = object()


class WriterMetrics(Protocol):
    """What the writer reports: worker.metrics.Metrics implements it; in the publisher process each call goes up
    the pipe to the worker's Metrics (process.RelayedMetrics)."""

    def publish_round_trip(self, seconds: float) -> None: ...

    def lease_lost(self) -> None: ...

    def job_done(self, status: str) -> None: ...

    def dead_letter(self) -> None: ...


RELAYED = tuple(name for name in vars(WriterMetrics) if not name.startswith("_"))  # its calls, by name


class Notices(Protocol):
    def put(self, notice: tuple[str, str, str]) -> None:
        """("cancel" | "lost", job id, lease), learned from the replies to token writes."""


class RedisWriter(threading.Thread):
    def __init__(self, r: redis_lib.Redis, keys: Keys, settings: calls.WorkerSettings, model: str,
                 metrics: WriterMetrics, notices: Notices, on_settled: Callable[[int], None]) -> None:
        """on_settled(n): n finished jobs handed over are written (or given up on), so they no longer sit in the
        group's pending list: the worker's intake counts them until then."""
        super().__init__(name="pagedq-publisher", daemon=True)
        self.r, self.keys, self.settings = r, keys, settings
        self.worker_id, self.model, self.ttl, self.metrics = settings.worker_id, model, settings.ttl, metrics
        self.notices, self.on_settled = notices, on_settled
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.give_up_at = float("inf")

    # ---- the process's side ---------------------------------------------------------------------------------

    def step(self, outputs: list[StepOutput], now: float) -> None:
        """One engine step's outputs; finished ones end their job."""
        self.inbox.put(("step", outputs, now))

    def end(self, view: JobView, status: str, finish_reason: str) -> None:
        """End a job the engine no longer runs (cancelled, expired, shut down) with its output so far."""
        self.inbox.put(("end", view, status, finish_reason, time.time()))

    def fail(self, view: JobView, type: str, message: str) -> None:
        self.inbox.put(("fail", view, ErrorInfo(type=type, message=message), time.time()))

    def release(self, view: JobView, mode: str, type: str = "", message: str = "") -> None:
        """Give a job back to the queue: "handback" (draining) or "retry" (it failed; dead-lettered once it
        used up its attempts)."""
        self.inbox.put(("release", view, mode, ErrorInfo(type=type or mode, message=message or mode), time.time()))

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop. Redis errors are retried until `timeout` runs out."""
        self.give_up_at = time.monotonic() + timeout
        self.inbox.put(_STOP)
        self.join(timeout + 1)

    # ---- the writer thread ----------------------------------------------------------------------------------

    def run(self) -> None:
        stop = False
        while not stop:
            batch = [self.inbox.get()]
            while True:
                try:
                    batch.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            if batch[-1] is _STOP or _STOP in batch:
                stop = True
                batch = [b for b in batch if b is not _STOP]
            if batch:
                self._flush_until_written(batch)

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
        n = sum(1 for op in batch if op[0] != "step") + sum(
            1 for op in batch if op[0] == "step" for out in op[1] if out.ends_job)
        self.on_settled(n)

    def flush(self, batch: list) -> None:
        chunks: list[tuple[RunningJob, calls.Chunk]] = []
        ends: list[tuple[RunningJob, str, calls.Call]] = []  # (job, its final status or "released", call)
        for op in batch:
            if op[0] == "step":
                self._step_calls(op[1], op[2], chunks, ends)
            else:
                ends.append(self._end_call(op))
        todo = [calls.publish(self.keys, [c for _, c in chunks])] if chunks else []
        todo += [call for _, _, call in ends]
        t = time.perf_counter()
        outs = run_calls(self.r, todo)
        self.on_settled(len(ends))
        self.metrics.publish_round_trip(time.perf_counter() - t)
        if chunks:
            self._read_acks([job for job, _ in chunks], outs.pop(0))
        for (job, status, _), out in zip(ends, outs, strict=True):
            self._read_end(job, status, out)

    def _step_calls(self, outputs: list[StepOutput], now: float, chunks: list, ends: list) -> None:
        for out in outputs:
            view = out.view
            job = view.job
            chunk = None
            if out.token_ids or out.text:
                chunk = calls.Chunk(job.id, job.lease, out.offset, len(out.token_ids), self._token_event(out))
            if out.ends_job:
                # The last chunk rides with the result: a stream never holds all tokens but no end.
                res = view.result(wire.COMPLETED, self.worker_id, self.model, now, FINISH.get(out.finish_reason))
                ends.append((job, wire.COMPLETED, calls.complete(self.keys, job.delivery, wire.COMPLETED,
                                                                 res.model_dump_json(), self.ttl, chunk)))
            elif chunk:
                chunks.append((job, chunk))

    def _end_call(self, op: tuple) -> tuple[RunningJob, str, calls.Call]:
        kind, view = op[0], op[1]
        job = view.job
        if kind == "end":
            _, _, status, reason, now = op
            res = view.result(status, self.worker_id, self.model, now, reason)
            return job, status, calls.complete(self.keys, job.delivery, status, res.model_dump_json(), self.ttl)
        if kind == "release":
            _, _, mode, err, _ = op
            return job, "released", calls.release(self.keys, job.delivery, self.settings, mode, err.type,
                                                  err.message)
        _, _, err, now = op
        res = view.result(wire.FAILED, self.worker_id, self.model, now, "error", error=err)
        return job, wire.FAILED, calls.fail(self.keys, job.delivery, res.model_dump_json(), self.ttl)

    def _read_acks(self, jobs: list[RunningJob], acks) -> None:
        if isinstance(acks, Exception):
            log.error("publish failed: %s", acks)
            return
        for job, ack in zip(jobs, acks, strict=True):
            if ack == "lost":
                self.metrics.lease_lost()
                log.warning("job %s: lease lost: token write refused", job.id)
            if ack != "ok":
                self.notices.put((ack, job.id, job.lease))

    def _read_end(self, job: RunningJob, status: str, out) -> None:
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
        several = out.view.several
        if not out.logprobs and not several:  # the hot case, a job per step: a format string, no generic encoder
            ids = ",".join(map(str, out.token_ids))
            return f'{{"type":"token","text":{encode_basestring(out.text)},"token_ids":[{ids}]}}'
        event = {"type": "token", "text": out.text, "token_ids": out.token_ids}
        if out.logprobs:
            lps = [TokenLogprob(token_id=t, logprob=lp, top=top)
                   for t, (lp, top) in zip(out.token_ids, out.logprobs, strict=False)]
            choice = out.choice
            if choice.logprobs is None:
                choice.logprobs = []
            choice.logprobs.extend(lps)
            event["logprobs"] = [x.model_dump() for x in lps]
        if several:  # which continuation; where it ended, so that a resumed job does not go on with it
            event["index"] = out.choice.index
            if out.finish_reason is not None:
                event["finish_reason"] = FINISH.get(out.finish_reason)
        return json.dumps(event)
