"""The publisher: a thread that writes the step loop's outputs to Redis, one pipelined round trip per batch.

The step loop only hands over Python objects; JSON encoding and the network happen here, off its thread.
Whatever piled up while a round trip was in flight goes out together in the next one.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time

import redis as redis_lib

from producer.keys import GROUP, Keys
from producer.protocol import ErrorInfo, TokenLogprob
from producer.scripts import Scripts
from worker.job import RunningJob
from worker.metrics import Metrics
from worker.pipeline import evalsha_all

log = logging.getLogger("pagedq.worker")

_STOP = object()


class Publisher(threading.Thread):
    def __init__(self, r: redis_lib.Redis, keys: Keys, scripts: Scripts, worker_id: str, model: str,
                 result_ttl: int, metrics: Metrics, max_attempts: int = 3, dlq_cap: int = 10_000) -> None:
        super().__init__(name="pagedq-publisher", daemon=True)
        self.r, self.keys, self.scripts = r, keys, scripts
        self.worker_id, self.model, self.ttl, self.metrics = worker_id, model, result_ttl, metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.max_attempts, self.dlq_cap = max_attempts, dlq_cap
        # To the step loop: ("cancel" | "lost", job id, lease), learned from publish and renew replies.
        self.notices: queue.SimpleQueue = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.give_up_at = float("inf")
        self.pending_acks = 0  # finished jobs handed over, not yet acked: they still sit in the group's PEL

    # ---- the step loop's side -------------------------------------------------------------------------------

    def step(self, items: list, now: float) -> None:
        """One engine step's outputs: [(job, RequestOutput, offset)], offset = the job's output tokens before
        this chunk; finished ones end their job."""
        ends = sum(1 for _, out, _ in items if out.finished)
        if ends:
            self._add_acks(ends)
        self.inbox.put(("step", items, now))

    def end(self, job: RunningJob, status: str, finish_reason: str) -> None:
        """End a job the engine no longer runs (cancelled, expired, shut down) with its output so far."""
        self._add_acks(1)
        self.inbox.put(("end", job, status, finish_reason, time.time()))

    def fail(self, job: RunningJob, type: str, message: str) -> None:
        self._add_acks(1)
        self.inbox.put(("fail", job, ErrorInfo(type=type, message=message), time.time()))

    def release(self, job: RunningJob, mode: str, type: str = "", message: str = "") -> None:
        """Give a job back to the queue: "handback" (draining) or "retry" (it failed; dead-lettered once it
        used up its attempts)."""
        self._add_acks(1)
        self.inbox.put(("release", job, mode, ErrorInfo(type=type or mode, message=message or mode), time.time()))

    def wait_acks(self, below: int, timeout: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.pending_acks < below, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop. Redis errors are retried until `timeout` runs out."""
        self.give_up_at = time.monotonic() + timeout
        self.inbox.put(_STOP)
        self.join(timeout + 1)

    def _add_acks(self, n: int) -> None:
        with self.cond:
            self.pending_acks += n
            self.metrics.pending_acks.set(self.pending_acks)

    # ---- the publisher thread -------------------------------------------------------------------------------

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
            1 for op in batch if op[0] == "step" for _, out, _ in op[1] if out.finished)
        with self.cond:
            self.pending_acks -= n
            self.cond.notify_all()

    def flush(self, batch: list) -> None:
        k = self.keys
        tok_keys, tok_args, tok_jobs = [], [], []
        ends = []  # (job, status, script, keys, args)
        for op in batch:
            kind = op[0]
            if kind == "step":
                _, items, now = op
                for job, out, offset in items:
                    chunk = self._token_event(job, out) if out.new_token_ids or out.new_text else ""
                    if out.finished:
                        # The last chunk rides with the result: a stream never holds all tokens but no end.
                        res = job.result("completed", self.worker_id, self.model, now, out=out)
                        ends.append(self._end_call(job, "completed", "done", res.model_dump_json(), chunk, offset))
                    elif chunk:
                        tok_keys += (k.job(job.id), k.events(job.id))
                        tok_args += (job.lease, offset, len(out.new_token_ids), chunk)
                        tok_jobs.append(job)
            elif kind == "end":
                _, job, status, reason, now = op
                res = job.result(status, self.worker_id, self.model, now, finish_reason=reason)
                ends.append(self._end_call(job, status, "cancelled" if status == "cancelled" else "error",
                                           res.model_dump_json()))
            elif kind == "release":
                _, job, mode, err, now = op
                ends.append((job, "released", "release",
                             [k.job(job.id), k.jobs, k.events(job.id), k.result(job.id), k.dlq],
                             [GROUP, job.entry, job.lease, mode, err.type, err.message, self.max_attempts,
                              self.ttl, self.dlq_cap, self.worker_id]))
            else:
                _, job, err, now = op
                res = job.result("failed", self.worker_id, self.model, now, finish_reason="error", error=err)
                ends.append((job, "failed", "fail",
                             [k.job(job.id), k.events(job.id), k.result(job.id), k.jobs],
                             [job.lease, GROUP, job.entry, res.model_dump_json(), self.ttl]))
        calls = [("publish", tok_keys, tok_args)] if tok_keys else []
        calls += [(script, keys, args) for _, _, script, keys, args in ends]
        t = time.perf_counter()
        replies = evalsha_all(self.r, self.scripts, calls)
        with self.cond:
            self.pending_acks -= len(ends)
            self.metrics.pending_acks.set(self.pending_acks)
            self.cond.notify_all()
        self.metrics.publish_seconds.observe(time.perf_counter() - t)
        if tok_keys:
            codes = replies.pop(0)
            if isinstance(codes, Exception):
                log.error("publish failed: %s", codes)
                codes = [0] * len(tok_jobs)
            for job, code in zip(tok_jobs, codes, strict=True):
                if code == 1:
                    self.notices.put(("cancel", job.id, job.lease))
                elif code == -1:
                    self.metrics.lease_lost.inc()
                    log.warning("job %s: lease lost: token write refused", job.id)
                    self.notices.put(("lost", job.id, job.lease))
        for (job, status, *_), reply in zip(ends, replies, strict=True):
            if isinstance(reply, Exception):
                if str(reply).startswith("LEASE_LOST"):
                    self.metrics.lease_lost.inc()
                    log.warning("job %s: lease lost: %s refused", job.id, status)
                else:
                    log.error("job %s: could not write its result: %s", job.id, reply)
            elif status == "released":
                if reply[0] == "dead":
                    log.warning("job %s: dead-lettered after %s attempts", job.id, reply[1])
                    self.metrics.job_done("failed")
                else:
                    log.info("job %s: handed back to the queue", job.id)
            else:
                self.metrics.job_done(status)

    def _end_call(self, job: RunningJob, status: str, event: str, result_json: str, chunk: str = "",
                  offset: int = 0) -> tuple:
        k = self.keys
        return (job, status, "complete", [k.job(job.id), k.events(job.id), k.result(job.id), k.jobs],
                [job.lease, GROUP, job.entry, status, event, result_json, self.ttl, chunk, offset])

    def _token_event(self, job: RunningJob, out) -> str:
        ev = {"type": "token", "text": out.new_text, "token_ids": out.new_token_ids}
        if out.logprobs:
            lps = [TokenLogprob(token_id=t, logprob=lp, top=top)
                   for t, (lp, top) in zip(out.new_token_ids, out.logprobs, strict=False)]
            if job.logprobs is None:
                job.logprobs = []
            job.logprobs.extend(lps)
            ev["logprobs"] = [x.model_dump() for x in lps]
        return json.dumps(ev)
