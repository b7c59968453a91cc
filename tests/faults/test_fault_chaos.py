"""Chaos, bounded in time: three workers on one queue, jobs submitted all along, a random worker SIGKILLed and a new
one started every few seconds, and one Redis restart (AOF, fsync always) in the middle. Afterwards every job
submitted has completed exactly once: one result, its event stream whole (each token once, in order, one end),
its text and tokens equal to an undisturbed run, nothing left pending and no dead letter."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
from faults import check_all, make_requests, started, wait_for

from producer import Client
from producer.errors import DuplicateJobError

pytestmark = pytest.mark.slow

CHAOS_S = 24.0
WORKERS = 3
# A short lease so that a killed worker's jobs move on within seconds; attempts enough that a job delivered to
# several workers in a row that all get killed still completes (it is never the job's fault here).
FLAGS = ("--max-num-seqs", "16", "--num-kv-blocks", "512", "--max-model-len", "256", "--lease-ms", "1500",
         "--max-attempts", "50")


class Producer(threading.Thread):
    """Submits jobs one at a time until stopped; a submit that fails (Redis restarting) is sent again with the
    same id until Redis has it (DuplicateJobError on a retry: the first one went through)."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.c = Client(url, queue=queue)
        self.reqs = make_requests(100_000, "c", 8)
        self.submitted: list = []
        self.retried = 0
        self.halt = threading.Event()

    def run(self) -> None:
        for req in self.reqs:
            while not self.halt.is_set():
                try:
                    self.c.submit(req)
                    break
                except DuplicateJobError:
                    break
                except Exception:  # Redis restarting: the app retries with the same id
                    self.retried += 1
                    time.sleep(0.1)
            else:
                return
            self.submitted.append(req)
            time.sleep(0.1)


def test_chaos(queue, pq_tiny_model, start_worker, pq_reference, pq_check_stream):
    from worker.redis_server import RedisServer

    seed = int(os.environ.get("PAGEDQ_CHAOS_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    t0 = time.monotonic()
    with RedisServer(aof=True) as srv:
        workers = [start_worker(queue, pq_tiny_model, *FLAGS, url=srv.url) for _ in range(WORKERS)]
        wait_for(lambda: any(started(w) for w in workers), 120, "a first worker")  # the others come up under load
        p = Producer(srv.url, queue)
        p.start()
        kills, restarted = 0, False
        end = time.monotonic() + CHAOS_S
        try:
            while time.monotonic() < end:
                time.sleep(rng.uniform(2.5, 4.0))
                if not restarted and time.monotonic() > end - CHAOS_S / 2:
                    srv.restart(down_s=0.5)  # once, mid-run: SIGTERM (the AOF is synced), then the same port
                    restarted = True
                    continue
                live = [w for w in workers if w.poll() is None]
                victim = rng.choice(live)
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait()
                kills += 1
                workers = [w for w in live if w is not victim]
                workers.append(start_worker(queue, pq_tiny_model, *FLAGS, url=srv.url))
        finally:
            p.halt.set()
            p.join(30)
        assert restarted and kills >= 4
        t_chaos = time.monotonic()
        c = Client(srv.url, queue=queue)
        reqs = p.submitted
        results = [c.result(r.id, timeout=max(5.0, 150 - (time.monotonic() - t0))) for r in reqs]
        t_drained = time.monotonic()
        stats = check_all(c, reqs, results, pq_reference, pq_check_stream)
        print(f"chaos phases: start+chaos {t_chaos - t0:.0f} s, drain {t_drained - t_chaos:.0f} s, "
              f"checks {time.monotonic() - t_drained:.0f} s")
        assert c.redis.xlen(c.keys.jobs) == 0 and c.redis.xpending(c.keys.jobs, "workers")["pending"] == 0
        assert c.redis.xlen(c.keys.dlq) == 0
        print(f"chaos (seed {seed}): {stats['in']} jobs, {kills} workers SIGKILLed, 1 Redis restart, "
              f"{stats['resumed']} jobs resumed on another delivery, {p.retried} submits retried; "
              f"{time.monotonic() - t0:.0f} s")
        c.close()
        p.c.close()
