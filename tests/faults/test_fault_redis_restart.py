"""redis-server restarted (AOF on) under a running worker: it reconnects with backoff and every job completes."""

import time

import pytest

from producer import Client

pytestmark = pytest.mark.slow


def test_redis_restart_mid_run(queue, pq_tiny_model, start_worker):
    from worker.redis_server import RedisServer

    with RedisServer(aof=True) as srv:
        c = Client(srv.url, queue=queue)
        start_worker(queue, pq_tiny_model, "--redis-url", srv.url, "--max-num-seqs", "8", "--num-kv-blocks",
                     "256", "--max-model-len", "256", "--lease-ms", "3000")
        jobs = c.submit_many([{"id": f"j{i}", "prompt": f"job {i}", "max_tokens": 24, "ignore_eos": True,
                               "temperature": 0} for i in range(40)])
        end = time.monotonic() + 120
        while c.redis.xlen(c.keys.events("j0")) < 3:
            assert time.monotonic() < end
            time.sleep(0.05)
        c.close()
        srv.restart(down_s=1.0)
        c = Client(srv.url, queue=queue)
        results = [c.result(j.id, timeout=180) for j in jobs]
        assert all(r.status == "completed" for r in results), [(r.id, r.error) for r in results]
        import redis

        r = redis.Redis.from_url(srv.url, decode_responses=True)
        from producer.flows import parse_event

        for res in results:
            evs = [parse_event(e, f) for e, f in r.xrange(c.keys.events(res.id))]
            assert sum(e.terminal for e in evs) == 1 and evs[-1].terminal
            assert [t for e in evs[:-1] for t in e.token_ids] == res.token_ids
        assert len({tuple(x.token_ids) for x in results}) >= 1
