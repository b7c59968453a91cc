"""The worker: one engine loop fed from a Redis Streams consumer group.

The step loop owns the engine. Intake reads only as many jobs as the engine can admit right now, and blocks
on Redis only when the engine is idle; the publisher thread writes the outputs. So a job waits in Redis, not
in the worker, and another worker of the queue can take it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field

import redis as redis_lib

from producer.keys import ENTRY_ID, GROUP, Keys
from producer.protocol import Limits
from producer.scripts import Scripts
from worker.job import RunningJob
from worker.metrics import Metrics
from worker.pipeline import evalsha_all
from worker.publisher import Publisher
from worker.validate import Rejected, parse, prompt_ids, sampling_params

log = logging.getLogger("pagedq.worker")


def make_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


@dataclass
class WorkerConfig:
    redis_url: str = "redis://localhost:6379/0"
    queue: str = "default"
    worker_id: str = field(default_factory=make_worker_id)
    result_ttl: int = 24 * 3600  # seconds; the event stream and the job hash live as long
    lease_ms: int = 60_000
    block_ms: int = 1000  # longest idle XREADGROUP BLOCK: how often an idle worker looks at its stop flag
    drain_timeout: float = 30.0  # on stop: how long running jobs may still finish
    served_models: tuple[str, ...] = ()  # names a request's `model` may use; empty: the engine's model name
    limits: Limits = field(default_factory=Limits)
    metrics_port: int | None = None


class Worker:
    def __init__(self, engine, config: WorkerConfig, redis: redis_lib.Redis | None = None) -> None:
        self.engine = engine
        self.cfg = config
        self.id = config.worker_id
        self.keys = Keys(config.queue)
        self.r = redis or redis_lib.Redis.from_url(config.redis_url, decode_responses=True)
        self.scripts = Scripts(self.r)
        self.metrics = Metrics(config.queue, config.metrics_port)
        self.served = set(config.served_models) or {engine.model_name}
        self.model = engine.model_name
        self.active: dict[str, RunningJob] = {}
        self.stop_event = threading.Event()
        self.publisher = Publisher(self.r, self.keys, self.scripts, self.id, self.model, config.result_ttl,
                                   self.metrics)
        self.steps = 0
        self.next_deadline_check = 0.0

    def stop(self) -> None:
        """Ask the loop to stop taking jobs; it finishes what it runs (up to drain_timeout), then returns."""
        self.stop_event.set()

    # ---- the loop -------------------------------------------------------------------------------------------

    def run(self) -> None:
        self._setup()
        self.publisher.start()
        log.info("worker %s on queue %r serving %s", self.id, self.cfg.queue, self.model)
        eng = self.engine
        drain_end = None
        try:
            while True:
                self._notices()
                if self.stop_event.is_set():
                    drain_end = drain_end or time.monotonic() + self.cfg.drain_timeout
                    if not eng.has_unfinished_requests() or time.monotonic() > drain_end:
                        break
                else:
                    self._intake()
                if eng.has_unfinished_requests():
                    self._step()
            self._abandon("worker_shutdown", "the worker shut down before the job finished")
        finally:
            self.publisher.close()
            log.info("worker %s stopped after %d steps", self.id, self.steps)

    def _setup(self) -> None:
        try:
            self.r.xgroup_create(self.keys.jobs, GROUP, id="0", mkstream=True)
        except redis_lib.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self.scripts.load_all(self.r)

    def _intake(self) -> None:
        # PEL = jobs in the engine + finished jobs not yet acked + what we read now <= what the engine admits.
        room = self.engine.num_admittable() - self.publisher.pending_acks
        idle = not self.engine.has_unfinished_requests()
        if room <= 0:
            if idle:  # only un-acked results hold the room: wait for the publisher, not for Redis
                self.publisher.wait_acks(self.publisher.pending_acks, 0.05)
            return
        try:
            reply = self.r.xreadgroup(GROUP, self.id, {self.keys.jobs: ">"}, count=room,
                                      block=self.cfg.block_ms if idle else None)
            if reply:
                self._admit(reply[0][1])
        except (redis_lib.ConnectionError, redis_lib.TimeoutError) as e:
            # Keep stepping what runs; take new jobs once Redis is back.
            log.warning("intake: redis unreachable (%s)", e)
            if idle:
                time.sleep(1.0)

    def _admit(self, entries: list) -> None:
        now = time.time()
        taken = []
        calls = []
        for entry, fields in entries:
            fields = fields or {}
            job_id = fields.get(ENTRY_ID) or entry
            lease = secrets.token_hex(8)
            taken.append((entry, fields, job_id, lease))
            calls.append(("start", [self.keys.job(job_id), self.keys.jobs],
                          [GROUP, entry, lease, self.id, self.cfg.lease_ms, repr(now)]))
        replies = evalsha_all(self.r, self.scripts, calls)
        for (entry, fields, job_id, lease), reply in zip(taken, replies, strict=True):
            if isinstance(reply, Exception):
                log.error("job %s: start failed: %s", job_id, reply)
                continue
            if reply[0] != "ok":
                log.info("job %s: skipped (%s)", job_id, reply[1])
                continue
            enq = float(reply[2]) if reply[2] else None
            job = RunningJob(id=job_id, entry=entry, lease=lease, attempts=int(reply[1]), enqueued_at=enq,
                             started_at=now)
            try:
                self._add(job, fields, now)
            except Rejected as e:
                log.info("job %s rejected: %s: %s", job_id, e.type, e.message)
                self.publisher.fail(job, e.type, e.message)

    def _add(self, job: RunningJob, fields: dict, now: float) -> None:
        req = job.request = parse(fields, job.id, self.cfg.limits, self.served)
        if req.timeout_s is not None:
            job.deadline = (job.enqueued_at or now) + req.timeout_s
            if now >= job.deadline:
                self.publisher.end(job, "expired", "expired")
                return
        params = sampling_params(req)
        ids = prompt_ids(req, self.engine)
        job.prompt_tokens = len(ids)
        try:
            self.engine.add_request(job.id, prompt_token_ids=ids, params=params, priority=req.priority)
        except ValueError as e:
            raise Rejected("invalid_request", str(e)) from None
        self.active[job.id] = job
        self.metrics.running.set(len(self.active))

    def _step(self) -> None:
        t = time.perf_counter()
        try:
            outs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            self._abandon("engine_error", f"the engine failed: {type(e).__name__}: {e}")
            raise
        self.steps += 1
        self.metrics.step_seconds.observe(time.perf_counter() - t)
        self.metrics.steps.inc()
        now = time.time()
        items = []
        ntok = 0
        for out in outs:
            job = self.active.get(out.request_id)
            if job is None:  # aborted meanwhile
                continue
            if job.first_token_at is None and out.new_token_ids:
                job.first_token_at = now
            ntok += len(out.new_token_ids)
            job.last = out
            if out.finished:
                del self.active[out.request_id]
            items.append((job, out))
        if items:
            self.publisher.step(items, now)
        self.metrics.tokens.inc(ntok)
        self.metrics.running.set(len(self.active))
        if now >= self.next_deadline_check:
            self._expire(now)

    def _expire(self, now: float) -> None:
        self.next_deadline_check = now + 0.5
        for job in [j for j in self.active.values() if j.deadline is not None and now >= j.deadline]:
            self._drop(job.id)
            self.publisher.end(job, "expired", "expired")

    def _notices(self) -> None:
        notices = self.publisher.notices
        while not notices.empty():
            kind, job_id = notices.get_nowait()
            job = self._drop(job_id)
            if job is None:
                continue
            if kind == "cancel":
                self.publisher.end(job, "cancelled", "cancelled")
            else:
                log.warning("job %s: lease lost; dropped", job_id)

    def _drop(self, job_id: str) -> RunningJob | None:
        job = self.active.pop(job_id, None)
        if job is not None:
            self.engine.abort(job_id)
            self.metrics.running.set(len(self.active))
        return job

    def _abandon(self, type: str, message: str) -> None:
        for job_id in list(self.active):
            job = self._drop(job_id)
            self.publisher.fail(job, type, message)
