"""A burst of jobs on idle workers is spread evenly over them (worker/intake.py, "Spread"), while a lone worker
still takes a whole burst into one batch."""

import contextlib
import json
import threading
import time
from collections import Counter

import pytest
import redis

from producer import Client

FLAGS = ("--max-num-seqs", "64", "--num-kv-blocks", "1024", "--max-model-len", "256")
SPREAD = 0.25  # each worker starts within this fraction of an equal share


def burst(n: int, tag: str) -> list[dict]:
    # Long enough that every job of the burst is still running when the last one is read.
    return [{"prompt": f"{tag} job {i}", "max_tokens": 48, "ignore_eos": True, "temperature": 0} for i in range(n)]


def wait_idle(rds, c: Client, pids: list[int], timeout: float = 180) -> None:
    """Until every worker's heartbeat is up and says it holds no job, and each worker had time to see the others
    (intake reads the heartbeats at most once a second)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ids = rds.zrange(c.keys.workers, 0, -1)
        recs = [json.loads(r) for r in (rds.mget([c.keys.worker(i) for i in ids]) if ids else []) if r]
        if len(recs) == len(pids) and all(r["jobs"] == 0 for r in recs):
            time.sleep(2.5)
            return
        time.sleep(0.2)
    raise AssertionError(f"workers not idle after {timeout}s: {recs}")


def run_burst(c: Client, n: int, tag: str) -> Counter:
    results = [j.result(timeout=300) for j in c.submit_many(burst(n, tag))]
    assert all(r.status == "completed" for r in results), [r.error for r in results if r.status != "completed"]
    return Counter(r.worker for r in results)


@pytest.mark.parametrize("workers", [2, 3])
def test_burst_spreads_over_idle_workers(redis_url, queue, rds, pq_tiny_model, start_worker, workers):
    c = Client(redis_url, queue=queue)
    procs = [start_worker(queue, pq_tiny_model, *FLAGS) for _ in range(workers)]
    for jobs in (16, 48):
        wait_idle(rds, c, [p.pid for p in procs])
        shares = run_burst(c, jobs, f"{jobs}")
        print(f"spread: {workers} workers, {jobs} jobs: {sorted(shares.values(), reverse=True)}")
        equal = jobs / workers
        assert len(shares) == workers, shares
        assert all(abs(n - equal) <= SPREAD * equal for n in shares.values()), (jobs, dict(shares))


def test_lone_worker_batches_a_whole_burst(redis_url, queue, rds, pq_tiny_model, start_worker):
    c = Client(redis_url, queue=queue)
    w = start_worker(queue, pq_tiny_model, *FLAGS)
    wait_idle(rds, c, [w.pid])
    seen = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            with contextlib.suppress(redis.ResponseError):
                seen.append(rds.xpending(c.keys.jobs, "workers")["pending"])
            time.sleep(0.002)

    t = threading.Thread(target=watch)
    t.start()
    try:
        shares = run_burst(c, 16, "lone")
    finally:
        done.set()
        t.join()
    assert len(shares) == 1
    assert max(seen) == 16, max(seen)  # all 16 held at once: one batch, nothing left for absent peers


def test_jobs_left_for_a_stalled_peer_are_taken_anyway(redis_url, queue, rds, pq_tiny_model, start_worker):
    """A live heartbeat whose worker never reads (its loop stuck): the jobs left for it are taken after the
    grace, not held forever."""
    c = Client(redis_url, queue=queue)
    w = start_worker(queue, pq_tiny_model, *FLAGS)
    wait_idle(rds, c, [w.pid])
    ghost = {"id": "ghost", "max_num_seqs": 64, "jobs": 0, "draining": False}
    rds.set(c.keys.worker("ghost"), json.dumps(ghost), px=120_000)
    rds.zadd(c.keys.workers, {"ghost": int(time.time() * 1000) + 120_000})
    time.sleep(1.5)  # the worker's view of the heartbeats turns over
    shares = run_burst(c, 16, "ghost")
    assert shares == Counter({next(iter(shares)): 16})
