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

from producer.keys import GROUP, Keys
from producer.scripts import Scripts
from worker.pipeline import evalsha_all

log = logging.getLogger("pagedq.worker")


class LeaseKeeper(threading.Thread):
    def __init__(self, r: redis_lib.Redis, keys: Keys, scripts: Scripts, worker_id: str, lease_ms: int,
                 held, notices: queue.SimpleQueue) -> None:
        """`held()` returns the jobs to renew (RunningJob); lost leases and cancels go to `notices`."""
        super().__init__(name="pagedq-leases", daemon=True)
        self.r, self.keys, self.scripts, self.worker_id = r, keys, scripts, worker_id
        self.lease_ms = lease_ms
        self.held = held
        self.notices = notices
        self.stop_event = threading.Event()
        # Three renewals per lease: one late or failed renewal still leaves the lease alive.
        self.interval = lease_ms / 3000

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
        keys = [self.keys.jobs] + [self.keys.job(j.id) for j in jobs]
        args: list = [GROUP, self.worker_id, self.lease_ms]
        for j in jobs:
            args += (j.lease, j.entry)
        (codes,) = evalsha_all(self.r, self.scripts, [("renew", keys, args)], retries=1)
        if isinstance(codes, Exception):
            raise codes
        for job, code in zip(jobs, codes, strict=True):
            if code == -1:
                self.notices.put(("lost", job.id, job.lease))
            elif code == 1:
                self.notices.put(("cancel", job.id, job.lease))

    def close(self) -> None:
        self.stop_event.set()
