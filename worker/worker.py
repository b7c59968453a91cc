"""The worker: one engine loop fed from a Redis Streams consumer group.

The step loop owns the engine. Intake reads only as many jobs as the engine can admit right now, and blocks
on Redis only when the engine is idle; the publisher process writes the outputs. So a job waits in Redis, not
in the worker, and another worker of the queue can take it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable

import redis as redis_lib

from producer import calls, scripts, wire
from producer.connection import connect, is_cluster
from producer.durability import Durability
from producer.keys import GROUP, LANES, Keys
from producer.protocol import INT32_MAX
from worker.config import WorkerConfig
from worker.heartbeat import Heartbeat
from worker.intake import Intake, Taken, engine_priority
from worker.job import RunningJob
from worker.leases import LeaseKeeper
from worker.metrics import Metrics
from worker.pipeline import run_calls_noting
from worker.publisher import DIED, Publisher
from worker.publisher.messages import Setup, tokenizer_spec
from worker.quarantine import Quarantine
from worker.resume import read_output
from worker.validate import Rejected, parse, prompt_ids, sampling_params
from worker.version import pagedq_version

log = logging.getLogger("pagedq.worker")
SWITCH_INTERVAL_S = 0.0005
# With the batch full, how often intake looks for urgent jobs to preempt for: a round trip every step would tax
# every step of a full batch; this bounds the tax and adds at most this to an urgent job's wait.
URGENT_POLL_S = 0.02
FLUSH_TIMEOUT_S = 30.0  # how long a failed step's jobs wait for their streams to be written before resuming


class EngineBroken(RuntimeError):
    """Engine steps fail with no request to blame: the worker hands its jobs back and stops."""


class Worker:
    def __init__(self, engine, config: WorkerConfig, redis: redis_lib.Redis | None = None) -> None:
        self.engine = engine
        self.cfg = config
        self.id = config.worker_id
        self.keys = Keys(config.queue)
        # socket_timeout cuts a read that never returns (a half-open connection); it must exceed block_ms.
        # encoding_errors: a producer that XADDs bytes that are not UTF-8 must get a failed job (its JSON no
        # longer parses), not a decode error that kills intake and every job read in the same batch.
        options = dict(decode_responses=True, encoding_errors="replace",
                       socket_timeout=max(config.socket_timeout, config.block_ms / 1000 + 2),
                       socket_connect_timeout=5, socket_keepalive=True)
        self.r = redis if redis is not None else connect(config.redis_url, **options)
        self.durability = Durability(config.durability, config.durability_replicas, config.durability_timeout_ms)
        if self.durability.timeout_ms >= 1000 * options["socket_timeout"]:
            raise ValueError(f"the durability timeout ({self.durability.timeout_ms} ms) must be shorter than the "
                             f"socket timeout ({options['socket_timeout']} s)")
        self.settings = calls.WorkerSettings(self.id, config.lease_ms, config.max_attempts, config.result_ttl,
                                             config.dlq_cap)
        self.metrics = Metrics(config.queue, config.metrics_port, model=engine.model_name)
        self.metrics.kv_total.set(engine.num_total_blocks)
        self.served = set(config.served_models) or {engine.model_name}
        self.model = engine.model_name
        self.active: dict[str, RunningJob] = {}
        self.stop_event = threading.Event()
        # The publisher process connects from the URL (a `redis` client given here serves the loop's own calls).
        self.publisher = Publisher(
            Setup(config.redis_url, options, is_cluster(self.r), config.queue, self.settings, self.model,
                  tokenizer_spec(engine.tokenizer), log.getEffectiveLevel(), self.durability), self.metrics)
        self.last_step_s = 0.0
        self.speculated = (0, 0)  # the engine's draft tokens proposed and accepted, as the metrics last counted them
        self.heartbeat = Heartbeat(self.r, self.keys, self.id, self._static_info(), config.heartbeat_s, self.metrics,
                                   self._live_state, config.lease_ms)
        self.leases = LeaseKeeper(self.r, self.keys, self.settings, lambda: list(self.active.copy().values()),
                                  self.publisher.notices, self.heartbeat, self.durability, self.metrics)
        self.intake = Intake(self.r, self.keys, self.id, config.lane_floor)
        # Jobs on their last delivery after failed ones (start.lua said "later"): each runs alone, once the
        # engine is empty, so that a job that kills its workers takes no other job down with it.
        self.deferred: list[Taken] = []
        self.solo: str | None = None  # the job running alone now
        # After a step raised: the search for its cause, and the jobs held out of the engine meanwhile (leased).
        self.quarantine: Quarantine | None = None
        self.parked: set[str] = set()
        self.steps = 0
        self.busy = False  # the engine had requests at the loop's last look
        self.next_reap = 0.0
        self.next_urgent_poll = 0.0

    def stop(self) -> None:
        """Ask the loop to stop taking jobs; it finishes what it runs (up to drain_timeout), then returns."""
        self.stop_event.set()

    # ---- the loop -------------------------------------------------------------------------------------------

    def run(self) -> None:
        # The lease, heartbeat and publisher-reply threads share the GIL with this loop: a short switch interval
        # hands it back to the loop within a fraction of a step instead of the default 5 ms.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._setup()
        self.publisher.start()
        self.leases.start()
        log.info("worker %s on queue %r serving %s", self.id, self.cfg.queue, self.model)
        eng = self.engine
        drain_end = None
        try:
            while True:
                self.metrics.kv_free.set(eng.num_free_blocks)
                self._notices()
                if self.stop_event.is_set():
                    drain_end = drain_end or time.monotonic() + self.cfg.drain_timeout
                    if not eng.has_unfinished_requests() or time.monotonic() > drain_end:
                        break
                else:
                    self._intake()
                if eng.has_unfinished_requests():
                    self._step()
                elif self.quarantine is not None:  # its group left the engine without a step (cancelled, say)
                    self._probe()
                elif self.active:
                    self._orphans()
                self._note_busy(eng.has_unfinished_requests())
            self._hand_back()
        finally:
            self.publisher.close()
            self.leases.close()
            log.info("worker %s stopped after %d steps", self.id, self.steps)

    def _note_busy(self, busy: bool) -> None:
        """A batch that starts or empties shows in the worker's record at once (a beat now), not up to a heartbeat
        later: else `pagedq status` can show a queue with nothing running beside a worker with a batch of one."""
        if busy != self.busy:
            self.busy = busy
            self.leases.refresh()

    def _setup(self) -> None:
        # The lanes' own streams always exist, so that a bare XADD to one is read (groups' streams get their
        # consumer group from take.lua).
        for stream in self.keys.lane_streams():
            try:
                self.r.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis_lib.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
            # A read that finds nothing does not make the consumer: made here, the worker is in the group (and in
            # `pagedq status`) before its first job.
            self.r.xgroup_createconsumer(stream, GROUP, self.id)
        scripts.load_all(self.r)

    def _intake(self) -> None:
        if self.quarantine is not None or self._alone_gate():
            return
        # PEL = jobs in the engine + finished jobs not yet acked + what we read now <= what the engine admits.
        room = self.engine.num_admittable() - self.publisher.pending_acks
        idle = not self.engine.has_unfinished_requests()
        try:
            if room <= 0:
                if idle:  # only un-acked results hold the room: wait for the publisher, not for Redis
                    self.publisher.wait_acks(self.publisher.pending_acks, 0.05)
                elif self.engine.config.preempt_for_priority:
                    self._urgent()
                return
            if time.monotonic() >= self.next_reap:
                self.next_reap = time.monotonic() + self.cfg.lease_ms / 2000
                room -= self._admit(self.intake.reap(room, self.cfg.lease_ms))
                if room <= 0:
                    return
            if not self._admit(self.intake.read(room, note_wake=idle, spread=True)) and idle:
                self.intake.wait(min(self.cfg.block_ms, self.cfg.lease_ms // 2))
        except (redis_lib.ConnectionError, redis_lib.TimeoutError) as e:
            # Keep stepping what runs; take new jobs once Redis is back.
            log.warning("intake: redis unreachable (%s)", e)
            if idle:
                time.sleep(1.0)

    def _urgent(self) -> None:
        """The batch is full: read jobs of a lane above that of running jobs, which the engine preempts for (as
        many as it has jobs below to preempt, less those read for it already and not started yet)."""
        now = time.monotonic()
        if now < self.next_urgent_poll:
            return
        self.next_urgent_poll = now + URGENT_POLL_S
        for rank, lane in enumerate(LANES[:-1]):
            below = self.engine.num_preemptible(engine_priority(lane, INT32_MAX))
            waiting = sum(1 for job in self.active.values()
                          if job.first_token_at is None and LANES.index(job.lane) <= rank)
            if below > waiting and self._admit(self.intake.read(below - waiting, lanes=LANES[:rank + 1])):
                return

    def _alone_gate(self) -> bool:
        """True while a job runs alone or waits to: intake takes nothing new then. Starts the next waiting one
        once the engine is empty."""
        if self.solo in self.active:
            return True
        self.solo = None
        if not self.deferred:
            return False
        if not self.active and not self.engine.has_unfinished_requests():
            self._admit([self.deferred.pop(0)], alone=True)
        return True

    def _admit(self, entries: list[Taken], alone: bool = False) -> int:
        """Start the jobs read; returns how many entries there were."""
        entries = self._forget_deleted(entries)
        if not entries:
            return 0
        now = time.time()
        # A foreign producer may XADD without an id field: the entry id names the job then.
        taken = [(calls.Delivery(t.fields.get(wire.ENTRY_ID) or t.entry, t.entry, secrets.token_hex(8), t.lane,
                                 t.group), t) for t in entries]
        outs = run_calls_noting(self.r, [calls.start(self.keys, d, self.settings, now, alone) for d, _ in taken],
                                self.durability, self.metrics)
        for (d, t), out in zip(taken, outs, strict=True):
            if isinstance(out, Exception):
                log.error("job %s: start failed: %s", d.job_id, out)
            elif out.outcome == "dead":
                log.warning("job %s: dead-lettered after %s deliveries", d.job_id, out.attempts)
                self.metrics.dead_letter()
            elif out.outcome == "skip":
                log.info("job %s: skipped (%s)", d.job_id, out.state)
            elif out.outcome == "later":
                log.warning("job %s: its last delivery after failed ones: it will run alone", d.job_id)
                self.deferred.append(t)
            elif out.outcome == "ok":
                self.solo = d.job_id if alone else self.solo
                self._begin(d, t.fields, out, now)
        return len(entries)

    def _forget_deleted(self, entries: list[Taken]) -> list[Taken]:
        """A reclaim finds entries deleted while pending (cancelled while queued) as bare ids: nothing to run; they
        leave the pending list here."""
        for t in entries:
            if t.fields is None:
                self.r.xack(self.keys.stream(t.lane, t.group), GROUP, t.entry)
        return [t for t in entries if t.fields is not None]

    def _begin(self, d: calls.Delivery, fields: dict, started: calls.Started, now: float) -> None:
        """Run a job this worker now holds: add it to the engine, or end it at once with a clear reason."""
        job_id = d.job_id
        if job_id in self.active:  # our own job, reclaimed after our renewals failed: run it afresh from its stream
            self._drop(job_id)
        job = RunningJob(id=job_id, entry=d.entry, lease=d.lease, attempts=started.attempts,
                         enqueued_at=started.enqueued_at, started_at=now, lane=d.lane, group=d.group)

        def begin() -> None:
            if started.emitted:
                self._read_resumed(job)
                log.info("job %s: resuming after %d tokens (attempt %d)", job_id, job.resumed_tokens, job.attempts)
            self._add(job, fields, now)

        self._guarded(job, begin)

    def _guarded(self, job: RunningJob, start: Callable[[], None]) -> None:
        """Run start(), which puts the job into the engine; a job it cannot run ends with a clear reason."""
        try:
            start()
            return
        except Rejected as e:
            log.info("job %s rejected: %s: %s", job.id, e.type, e.message)
            self._drop(job.id)
            self.publisher.fail(job, e.type, e.message)
        except Exception as e:
            # Not the request's fault as far as we know: another delivery may pass; repeated, it dead-letters.
            log.exception("job %s: failed in the worker", job.id)
            self._drop(job.id)
            self.publisher.release(job, wire.RETRY, "worker_error", f"{type(e).__name__}: {e}")

    def _read_resumed(self, job: RunningJob) -> None:
        """What the job's earlier runs streamed, which this one continues."""
        job.resumed = read_output(self.r, self.keys, job.id)

    def _add(self, job: RunningJob, fields: dict, now: float) -> None:
        req = job.request = parse(fields, job.id, self.cfg.limits, self.served)
        if req.timeout_s is not None:
            job.deadline = (job.enqueued_at or now) + req.timeout_s
            if now >= job.deadline:
                self.publisher.end(job, wire.EXPIRED, "expired", _past_deadline(job, now, "before it started"))
                return
        if self._enter(job):
            self.metrics.job_started(job.enqueued_at, job.started_at, job.prompt_tokens, job.attempts, job.lane,
                                     job.group)

    def _enter(self, job: RunningJob) -> bool:
        """Put a job the worker holds into the engine, going on from what it streamed before (job.resumed) ->
        whether it runs now (False: it had streamed all it may, and ends here)."""
        req = job.request
        params = sampling_params(req)
        ids = prompt_ids(req, self.engine)
        job.prompt_tokens = len(ids)
        if job.resumed and self._streamed_all(job, len(ids)):
            # Its last run streamed every token it may have but ended before the result: finish it here.
            self._drop(job.id)
            self.publisher.end(job, wire.COMPLETED, "length")
            return False
        resume = {i: (tokens, text, reason) for i, tokens, text, reason in job.resumed}
        try:
            self.engine.add_request(job.id, prompt_token_ids=ids, params=params,
                                    priority=engine_priority(job.lane, req.priority), deadline=job.deadline,
                                    resume=resume)
        except ValueError as e:
            raise Rejected("invalid_request", str(e)) from None
        self.active[job.id] = job
        self.publisher.begin(job, ids)
        self.metrics.running.set(len(self.active))
        return True

    def _streamed_all(self, job: RunningJob, prompt_len: int) -> bool:
        """Whether every continuation of the job had ended or streamed all the tokens it may have."""
        req = job.request
        if not req.several:
            return self._full(job.resumed_choice(0)[0], prompt_len, req.max_tokens)
        return all(reason is not None or self._full(tokens, prompt_len, req.max_tokens)
                   for tokens, _, reason in map(job.resumed_choice, range(req.n)))

    def _full(self, tokens: list[int], prompt_len: int, max_tokens: int) -> bool:
        return len(tokens) >= max_tokens or prompt_len + len(tokens) >= self.engine.max_model_len

    def _step(self) -> None:
        t = time.perf_counter()
        try:
            outs = self.engine.step()
        except Exception as e:
            self._step_failed(e)
            return
        self.steps += 1
        self.last_step_s = time.perf_counter() - t
        for job_id, why in self.engine.pop_refused():  # a constraint that did not compile: the job's own fault
            job = self.active.pop(job_id, None)
            if job is not None:
                self.publisher.fail(job, "invalid_request", why)
        now = time.time()
        items, firsts, ends, ntok = self._collect(outs, now)
        self._observe_step(firsts, ends, ntok, now)
        if items:
            self.publisher.step(items, now)
        self.metrics.running.set(len(self.active))
        self._expire(now)
        if self.quarantine is not None:
            self._probe()
        self.engine.record_phase("publish")

    def _orphans(self) -> None:
        """Jobs the worker holds that an idle engine no longer has: it ended them without a last output (a bug).
        They fail with that said, rather than hold their lease for ever."""
        for job_id in [j for j in self.active if self.engine.landed(j) is None]:
            log.error("job %s: the engine dropped it without a result", job_id)
            job = self._drop(job_id)
            self.publisher.fail(job, "engine_error", "the engine ended this job without a result")

    # ---- a step that raised: blame only its cause (worker.quarantine) ---------------------------------------

    def _step_failed(self, error: Exception) -> None:
        """The engine is reset and every job it held is parked; the suspects run again apart, a group at a time,
        until the cause runs alone and fails again. What the others streamed stays: they go on from there."""
        self.metrics.failed_steps.inc()
        ran = [job_id for job_id in self.active if job_id not in self.parked]
        landed = {job_id: self.engine.landed(job_id) or 0 for job_id in ran}
        self.engine.reset()
        self.parked.update(ran)
        self.metrics.running.set(len(self.active) - len(self.parked))
        message = f"{type(error).__name__}: {error}"
        if self.quarantine is None:
            log.error("engine step failed with %d jobs in the engine: running them apart to find the cause",
                      len(ran), exc_info=error)
            self.quarantine = Quarantine(landed)
        else:
            log.warning("engine step failed again, with %d suspects in the engine: %s", len(ran), message)
            cause = self.quarantine.failed(landed)
            if cause is not None:
                self._convict(cause, message)
        self._next_group()

    def _convict(self, job_id: str, message: str) -> None:
        """A job whose step failed while it ran alone: unless a request of no consequence fails too (then nothing
        is to blame but the engine or the device), the job fails with the error."""
        problem = self.engine.self_check()
        if problem is not None:
            self._broken(message, problem)
        log.error("job %s: the engine step fails on it alone (%s): failing it", job_id, message)
        self.metrics.convicted.inc()
        job = self._drop(job_id)
        if job is not None:
            self.publisher.fail(job, "engine_error", f"the engine failed on this job: {message}")

    def _broken(self, message: str, problem: str) -> None:
        log.critical("engine steps fail with no request to blame (%s; a 2-token check request alone: %s): the "
                     "device, the model or the engine is broken. Handing %d jobs back to the queue and stopping",
                     message, problem, len(self.active))
        self._hand_back()
        raise EngineBroken(f"engine steps fail with no request to blame: {problem}")

    def _probe(self) -> None:
        """After a step during the search: once the group running passed its marks, the next group runs."""
        q = self.quarantine
        q.drop([job_id for job_id in q.suspects + q.cleared if job_id not in self.active])
        if q.running and not q.passed(self.engine.landed):
            return
        if not q.todo:
            self._end_quarantine()
            return
        for job_id in q.cleared:  # they wait, out of the engine, until the search ends
            if job_id not in self.parked:
                self.engine.abort(job_id)
                self.parked.add(job_id)
        self._next_group()

    def _next_group(self) -> None:
        q = self.quarantine
        while True:
            group = q.next_group()
            if group is None:
                self._end_quarantine()
                return
            self._unpark(group)
            q.drop([job_id for job_id in group if job_id not in self.active])
            if q.running:
                return

    def _end_quarantine(self) -> None:
        """Every group ran: the parked jobs run together again. A job of a group that failed again with no job in
        it convicted was near a fault that needs company: that counts against it, and a job that counts
        max_attempts goes back to the queue as a failed delivery (so that its last delivery runs alone)."""
        q, self.quarantine = self.quarantine, None
        log.info("fault search over: %s convicted, %d jobs cleared", q.convicted or "none", len(q.cleared))
        for job in [self.active[j] for j in q.unexplained() if j in self.active]:
            job.unexplained_faults += 1
            if job.unexplained_faults >= self.cfg.max_attempts:
                self._drop(job.id)
                self.publisher.release(job, wire.RETRY, "engine_error",
                                       f"in {job.unexplained_faults} fault searches whose failed steps it was in with "
                                       f"no job to blame")
        self._unpark(list(self.parked))

    def _unpark(self, job_ids: list[str]) -> None:
        """Parked jobs go back into the engine, each from what its event stream holds."""
        if not job_ids:
            return
        jobs = [self.active[j] for j in job_ids if j in self.active]
        try:
            if not self.publisher.flush(FLUSH_TIMEOUT_S):
                raise redis_lib.TimeoutError(f"streams not written after {FLUSH_TIMEOUT_S:.0f} s")
            for job in jobs:
                self._read_resumed(job)
        except (redis_lib.ConnectionError, redis_lib.TimeoutError) as e:
            # What the streams hold is not known now: no fault of the jobs'. Another worker resumes them from there.
            log.warning("redis unreachable (%s): handing %d parked jobs back", e, len(jobs))
            for job in jobs:
                self._drop(job.id)
                self.publisher.release(job, wire.HANDBACK)
            return
        for job in jobs:
            self.parked.discard(job.id)
            self._guarded(job, lambda job=job: self._enter(job))

    def _collect(self, outs: list, now: float) -> tuple[list, list, list, int]:
        """One pass over a step's outputs -> those of the jobs held (the publisher's), (job, output) pairs for
        first tokens and for finished jobs, and the tokens generated. Runs per job per step: kept to one loop."""
        active = self.active
        items, firsts, ends, ntok = [], [], [], 0
        for out in outs:
            job = active.get(out.request_id)
            if job is None:  # aborted meanwhile
                continue
            n = len(out.new_token_ids)
            if job.first_token_at is None and n:
                job.first_token_at = now
                firsts.append((job, out))
            if out.request_finished:
                del active[out.request_id]
                ends.append((job, out))
            items.append(out)
            ntok += n
        return items, firsts, ends, ntok

    def _observe_step(self, firsts: list, ends: list, generated: int, now: float) -> None:
        """Metrics of one step: batch size, first tokens, finished jobs."""
        m, batch, eng = self.metrics, self.engine.last_batch, self.engine
        m.step_seconds.observe(self.last_step_s)
        m.steps.inc()
        m.tokens.inc(generated)
        if batch.seqs:
            m.step(len(batch.seqs), batch.num_tokens, len(batch.preempted), generated)
        for job, out in firsts:
            m.first_token(job.enqueued_at, job.started_at, now, out.num_cached_tokens, job.lane)
        for job, out in ends:
            m.finished(job.enqueued_at, job.started_at, job.first_token_at, now,
                       sum(len(c.token_ids) for c in out.choices) - job.resumed_tokens, job.lane, job.group)
        m.engine_state(eng.num_running, eng.num_waiting, eng.num_free_blocks, eng.num_total_blocks)
        spec = eng.speculation
        if spec.proposed != self.speculated[0]:
            m.spec_proposed.inc(spec.proposed - self.speculated[0])
            m.spec_accepted.inc(spec.accepted - self.speculated[1])
            self.speculated = (spec.proposed, spec.accepted)

    def _static_info(self) -> dict:
        cfg = self.engine.config
        return {"model": self.model, "served": sorted(self.served), "device": cfg.device, "dtype": cfg.dtype,
                "max_num_seqs": cfg.max_num_seqs, "version": pagedq_version(), "host": socket.gethostname(),
                "pid": os.getpid()}

    def _live_state(self) -> dict:
        """For the heartbeat thread: plain reads of counters and list lengths the step loop updates."""
        eng = self.engine
        running, waiting = eng.request_counts()
        total, free = eng.num_total_blocks, eng.num_free_blocks
        return {"jobs": len(self.active), "running": running, "waiting": waiting, "kv_blocks_used": total - free,
                "kv_blocks_total": total, "steps": self.steps, "last_step_s": round(self.last_step_s, 6),
                "jobs_finished": self.metrics.jobs_finished, "draining": self.stop_event.is_set()}

    def _expire(self, now: float) -> None:
        for job in [j for j in self.active.values() if j.deadline is not None and now >= j.deadline]:
            self._drop(job.id)
            where = "while it ran" if job.first_token_at is not None else "while it waited in the worker's batch"
            self.publisher.end(job, wire.EXPIRED, "expired", _past_deadline(job, now, where))

    def _notices(self) -> None:
        notices = self.publisher.notices
        while not notices.empty():
            kind, job_id, lease = notices.get_nowait()
            if kind == DIED:
                raise RuntimeError("the publisher process exited: this worker can no longer write results")
            held = self.active.get(job_id)
            if held is None or held.lease != lease:  # about an earlier delivery of the job: stale
                continue
            job = self._drop(job_id)
            if kind == "cancel":
                self.publisher.end(job, wire.CANCELLED, "cancelled")
            else:
                self.publisher.forget(job)
                log.warning("job %s: lease lost; dropped from the batch", job_id)

    def _drop(self, job_id: str) -> RunningJob | None:
        job = self.active.pop(job_id, None)
        self.parked.discard(job_id)
        if self.quarantine is not None:
            self.quarantine.drop([job_id])
        if job is not None:
            self.engine.abort(job_id)
            self.metrics.running.set(len(self.active))
        return job

    def _hand_back(self) -> None:
        """Give the jobs still running back to the queue, with their tokens so far: another worker resumes them."""
        if self.active:
            log.info("handing %d unfinished jobs back to the queue", len(self.active))
        for job_id in list(self.active):
            self.publisher.release(self._drop(job_id), wire.HANDBACK)


def _past_deadline(job: RunningJob, now: float, where: str) -> str:
    """An expired job's reason: rather than run late, it ends at its deadline, wherever it is then."""
    return (f"its deadline (timeout_s={job.request.timeout_s:g} from enqueue) passed {where}, "
            f"{now - (job.enqueued_at or job.started_at):.1f} s after it was queued")
