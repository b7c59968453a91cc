"""Fault test 9, soak: 2,000 jobs through one worker. Afterwards every KV block is free again (the worker's
Prometheus gauges) and, once the result TTL passes, Redis holds exactly the keys it held before the jobs."""

import re
import time
import urllib.request

import pytest
from faults import wait_for

from producer import Client, JobResult

pytestmark = pytest.mark.slow

JOBS = 2000
CHUNK = 250  # jobs per submit_many round trip
TTL = 6  # --result-ttl, seconds: results are read as they land, well inside it


def gauge(port: int, name: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def collect(c: Client, ids: list[str], proc, timeout: float, on_sweep) -> dict[str, JobResult]:
    """Read results as they land: one MGET sweep over the missing ones every 50 ms, so none expires unread."""
    got: dict[str, JobResult] = {}
    end = time.monotonic() + timeout
    while len(got) < len(ids):
        assert proc.poll() is None, "the worker died"
        assert time.monotonic() < end, f"{len(ids) - len(got)} results missing after {timeout} s"
        on_sweep()
        missing = [i for i in ids if i not in got]
        for k in range(0, len(missing), 500):
            part = missing[k:k + 500]
            for job_id, raw in zip(part, c.redis.mget([c.keys.result(i) for i in part]), strict=True):
                if raw:
                    got[job_id] = JobResult.model_validate_json(raw)
        time.sleep(0.05)
    return got


def test_soak_2000_jobs(queue, pq_tiny_model, start_worker):
    from worker.redis_server import RedisServer, free_port

    # A server of its own: the session's holds other tests' keys, which expire on their own schedule.
    with RedisServer() as srv:
        c = Client(srv.url, queue=queue)
        port = free_port()
        proc = start_worker(queue, pq_tiny_model, "--redis-url", srv.url, "--max-num-seqs", "64",
                            "--num-kv-blocks", "512", "--max-model-len", "128", "--result-ttl", str(TTL),
                            "--metrics-port", str(port))
        # The worker's consumer group creates the jobs stream and its first heartbeat the stats stream; those keys
        # stay, the rest must go.
        wait_for(lambda: c.redis.exists(c.keys.jobs, c.keys.stats) == 2 and proc.poll() is None, 120,
                 "the worker to start")
        wait_for(lambda: gauge(port, "pagedq_kv_blocks_total"), 30, "the metrics endpoint")
        baseline = c.redis.dbsize()
        total = gauge(port, "pagedq_kv_blocks_total")
        assert total == 512

        t = time.monotonic()
        ids = []
        for k in range(0, JOBS, CHUNK):
            reqs = [{"prompt": f"soak job {i} of many", "max_tokens": 2 + i % 3, "ignore_eos": True,
                     "temperature": 0 if i % 2 else 0.8} for i in range(k, k + CHUNK)]
            ids += [j.id for j in c.submit_many(reqs)]
        seen = {"keys": 0, "free": total}  # the peak key count; the fewest free blocks (the gauge is live)

        def sweep() -> None:
            seen["keys"] = max(seen["keys"], c.redis.dbsize())
            seen["free"] = min(seen["free"], gauge(port, "pagedq_kv_blocks_free"))

        results = collect(c, ids, proc, 240, sweep)
        elapsed = time.monotonic() - t
        assert all(r.status == "completed" for r in results.values()), [
            (r.id, r.status, r.error) for r in results.values() if r.status != "completed"][:5]
        assert sum(len(r.token_ids) for r in results.values()) == sum(2 + i % 3 for i in range(JOBS))

        wait_for(lambda: gauge(port, "pagedq_kv_blocks_free") == total, 10, "every KV block to be free")
        assert c.redis.xlen(c.keys.jobs) == 0 and c.redis.xpending(c.keys.jobs, "workers")["pending"] == 0
        assert seen["free"] < total

        # Results, event streams and job hashes all carry the TTL; Redis's active expiry removes them soon after.
        wait_for(lambda: c.redis.dbsize() <= baseline, TTL + 30, "the keys to expire")
        after = c.redis.dbsize()
        assert after == baseline, sorted(c.redis.scan_iter(count=1000))[:20]
        assert proc.poll() is None
        print(f"soak: {JOBS} jobs in {elapsed:.1f} s; KV blocks free {total:.0f}/{total:.0f} "
              f"(fewest while running: {seen['free']:.0f}); "
              f"keys: baseline {baseline}, at the peak {seen['keys']}, after the TTL {after}")
