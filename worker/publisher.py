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
                 result_ttl: int, metrics: Metrics) -> None:
        super().__init__(name="pagedq-publisher", daemon=True)
        self.r, self.keys, self.scripts = r, keys, scripts
        self.worker_id, self.model, self.ttl, self.metrics = worker_id, model, result_ttl, metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        # To the step loop: ("cancel" | "lost", job id), learned from publish replies.
        self.notices: queue.SimpleQueue = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.pending_acks = 0  # finished jobs handed over, not yet acked: they still sit in the group's PEL

    # ---- the step loop's side -------------------------------------------------------------------------------

    def step(self, items: list, now: float) -> None:
        """One engine step's outputs: [(job, RequestOutput)]; finished ones end their job."""
        ends = sum(1 for _, out in items if out.finished)
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

    def wait_acks(self, below: int, timeout: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.pending_acks < below, timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.inbox.put(_STOP)
        self.join(timeout)

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
                try:
                    self.flush(batch)
                except Exception:
                    log.exception("publisher: could not write %d items to redis", len(batch))

    def flush(self, batch: list) -> None:
        k = self.keys
        tok_keys, tok_args, tok_jobs = [], [], []
        ends = []  # (job, status, script, keys, args)
        for op in batch:
            kind = op[0]
            if kind == "step":
                _, items, now = op
                for job, out in items:
                    if out.new_token_ids or out.new_text:
                        tok_keys += (k.job(job.id), k.events(job.id))
                        tok_args += (job.lease, self._token_event(job, out))
                        tok_jobs.append(job)
                    if out.finished:
                        res = job.result("completed", self.worker_id, self.model, now, out=out)
                        ends.append(self._end_call(job, "completed", "done", res.model_dump_json()))
            elif kind == "end":
                _, job, status, reason, now = op
                res = job.result(status, self.worker_id, self.model, now, finish_reason=reason)
                ends.append(self._end_call(job, status, "cancelled" if status == "cancelled" else "error",
                                           res.model_dump_json()))
            else:
                _, job, err, now = op
                res = job.result("failed", self.worker_id, self.model, now, finish_reason="error", error=err)
                ends.append((job, "failed", "fail",
                             [k.job(job.id), k.events(job.id), k.result(job.id), k.jobs],
                             [job.lease, GROUP, job.entry, res.model_dump_json(), self.ttl]))
        calls = [("publish", tok_keys, tok_args)] if tok_keys else []
        calls += [(script, keys, args) for _, _, script, keys, args in ends]
        t = time.perf_counter()
        try:
            replies = evalsha_all(self.r, self.scripts, calls)
        finally:
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
                    self.notices.put(("cancel", job.id))
                elif code == -1:
                    self.metrics.lease_lost.inc()
                    self.notices.put(("lost", job.id))
        for (job, status, *_), reply in zip(ends, replies, strict=True):
            if isinstance(reply, Exception):
                if str(reply).startswith("LEASE_LOST"):
                    self.metrics.lease_lost.inc()
                    log.warning("job %s: lease lost, result not written", job.id)
                else:
                    log.error("job %s: could not write its result: %s", job.id, reply)
            else:
                self.metrics.job_done(status)

    def _end_call(self, job: RunningJob, status: str, event: str, result_json: str) -> tuple:
        k = self.keys
        return (job, status, "complete", [k.job(job.id), k.events(job.id), k.result(job.id), k.jobs],
                [job.lease, GROUP, job.entry, status, event, result_json, self.ttl])

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
