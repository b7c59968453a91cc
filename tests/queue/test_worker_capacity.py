"""The worker never holds more jobs (pending entries) than its engine can admit."""

import contextlib
import threading
import time

import redis

from producer import Client

MAX_NUM_SEQS = 3


def test_pending_never_exceeds_engine_room(redis_url, queue, rds, pq_tiny_model, start_worker):
    c = Client(redis_url, queue=queue)
    jobs = c.submit_many([{"prompt": f"job {i}", "max_tokens": 8 + i % 5, "ignore_eos": True}
                          for i in range(30)])
    start_worker(queue, pq_tiny_model, "--max-num-seqs", str(MAX_NUM_SEQS), "--num-kv-blocks", "64",
                 "--max-model-len", "256")
    seen = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            with contextlib.suppress(redis.ResponseError):  # no group until the worker starts
                seen.append(rds.xpending(c.keys.jobs, "workers")["pending"])
            time.sleep(0.002)

    t = threading.Thread(target=watch)
    t.start()
    try:
        results = [j.result(timeout=180) for j in jobs]
    finally:
        done.set()
        t.join()
    assert all(r.status == "completed" for r in results)
    assert max(seen) <= MAX_NUM_SEQS, max(seen)
    assert max(seen) >= 2  # it was loaded: the bound was tested, not idled past
    assert rds.xlen(c.keys.jobs) == 0
