"""The lease keeper: a timer thread that renews the leases of every job the worker holds.

It runs apart from the engine loop, so a long step (a big prefill, a slow GPU) never lets a healthy job's
lease lapse; only a worker that is truly gone or frozen (SIGKILL, SIGSTOP, a lost network) stops renewing,
and then the reaper of another worker takes its jobs after the lease timeout.
"""

from __future__ import annotations

import logging
import queue
import threading

import redis as redis_lib

from producer import calls
from producer.keys import Keys
from worker.pipeline import run_calls

log = logging.getLogger("pagedq.worker")


class LeaseKeeper(threading.Thread):
    def __init__(self, r: redis_lib.Redis, keys: Keys, settings: calls.WorkerSettings, held,
                 notices: queue.SimpleQueue) -> None:
        """`held()` returns the jobs to renew (RunningJob); lost leases and cancels go to `notices`."""
        super().__init__(name="pagedq-leases", daemon=True)
        self.r, self.keys, self.settings = r, keys, settings
        self.held = held
        self.notices = notices
        self.stop_event = threading.Event()
        # Three renewals per lease: one late or failed renewal still leaves the lease alive.
        self.interval = settings.lease_ms / 3000

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            try:
                self.renew()
            except Exception as e:  # Redis away: try again next tick; the lease outlives a few misses
                log.warning("lease renewal failed: %s", e)

    def renew(self) -> None:
        jobs = self.held()
        if not jobs:
            return
        (acks,) = run_calls(self.r, [calls.renew(self.keys, self.settings, [j.delivery for j in jobs])], retries=1)
        if isinstance(acks, Exception):
            raise acks
        for job, ack in zip(jobs, acks, strict=True):
            if ack != "ok":
                self.notices.put((ack, job.id, job.lease))

    def close(self) -> None:
        self.stop_event.set()
