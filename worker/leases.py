"""The lease keeper: a timer thread that renews the leases of every job the worker holds.

It runs apart from the engine loop, so a long step (a big prefill, a slow GPU) never lets a healthy job's
lease lapse; only a worker that is truly gone or frozen (SIGKILL, SIGSTOP, a lost network) stops renewing,
and then the reaper of another worker takes its jobs after the lease timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import redis as redis_lib

from producer import calls
from producer.durability import ASYNC_DURABILITY, Durability
from producer.keys import Keys
from worker.heartbeat import Heartbeat
from worker.pipeline import run_calls_noting

log = logging.getLogger("pagedq.worker")


class LeaseKeeper(threading.Thread):
    def __init__(self, r: redis_lib.Redis, keys: Keys, settings: calls.WorkerSettings, held,
                 notices: queue.SimpleQueue, heartbeat: Heartbeat | None = None,
                 durability: Durability = ASYNC_DURABILITY, metrics=None) -> None:
        """`held()` returns the jobs to renew (RunningJob); lost leases and cancels go to `notices`."""
        super().__init__(name="pagedq-leases", daemon=True)
        self.r, self.keys, self.settings = r, keys, settings
        self.durability, self.metrics = durability, metrics
        self.held = held
        self.notices = notices
        self.heartbeat = heartbeat
        self.stop_event = threading.Event()
        self.wake = threading.Event()  # a beat wanted before the next tick (refresh), or the stop
        # Three renewals per lease: one late or failed renewal still leaves the lease alive. The heartbeat
        # rides on the same tick (renewing more often than needed costs one small round trip).
        self.interval = settings.lease_ms / 3000
        if heartbeat is not None:
            self.interval = min(self.interval, heartbeat.interval_s)

    def run(self) -> None:
        self._beat()  # at once: a worker shows up in `pagedq status` as soon as it runs
        next_tick = time.monotonic() + self.interval
        while True:
            self.wake.wait(max(0.0, next_tick - time.monotonic()))
            self.wake.clear()
            if self.stop_event.is_set():
                break
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.interval
                try:
                    self.renew()
                except Exception as e:  # Redis away: try again next tick; the lease outlives a few misses
                    log.warning("lease renewal failed: %s", e)
            self._beat()
        if self.heartbeat is not None:  # here, so that no beat of this thread can follow the removal
            try:
                self.heartbeat.remove()
            except Exception as e:
                log.warning("could not remove the heartbeat: %s", e)

    def _beat(self) -> None:
        if self.heartbeat is None:
            return
        try:
            self.heartbeat.beat()
        except Exception as e:  # a missed beat only ages the record; the next one renews it
            log.warning("heartbeat failed: %s", e)

    def renew(self) -> None:
        jobs = self.held()
        if not jobs:
            return
        (acks,) = run_calls_noting(self.r, [calls.renew(self.keys, self.settings, [j.delivery for j in jobs])],
                                   self.durability, self.metrics, retries=1)
        if isinstance(acks, Exception):
            raise acks
        for job, ack in zip(jobs, acks, strict=True):
            if ack != "ok":
                self.notices.put((ack, job.id, job.lease))

    def refresh(self) -> None:
        """Beat now rather than at the next tick: the worker's record follows a change the step loop made (its
        batch emptied), so that `pagedq status` shows no running job on the queue beside a batch of one."""
        self.wake.set()

    def close(self, timeout: float = 5.0) -> None:
        self.stop_event.set()
        self.wake.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)  # let it remove the heartbeat before the process exits
