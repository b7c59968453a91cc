"""Cancel and expiry, queued and running, against an in-process worker whose engine we can inspect: a
cancelled or expired job leaves the batch, and every KV block comes back."""

import threading
import time

import pytest

from producer import Client


@pytest.fixture
def inproc(redis_url, queue, pq_tiny_model):
    from engine import EngineConfig, LLMEngine
    from worker.worker import Worker, WorkerConfig

    eng = LLMEngine(EngineConfig(model=pq_tiny_model, max_num_seqs=4, num_kv_blocks=512, max_model_len=2048))
    w = Worker(eng, WorkerConfig(redis_url=redis_url, queue=queue, lease_ms=2000, block_ms=200))
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    yield eng
    w.stop()
    t.join(30)


def wait_tokens(rds, c, job_id, n: int = 1) -> None:
    end = time.monotonic() + 60
    while rds.xlen(c.keys.events(job_id)) < n:
        assert time.monotonic() < end
        time.sleep(0.01)


def test_cancel_queued_and_running(redis_url, queue, rds, inproc):
    c = Client(redis_url, queue=queue)
    # Four long jobs fill the batch; the fifth waits in Redis and is cancelled there.
    running = c.submit_many([{"id": f"r{i}", "prompt": f"run {i}", "max_tokens": 2000, "ignore_eos": True}
                             for i in range(4)])
    queued = c.submit(id="q", prompt="never runs", max_tokens=4)
    wait_tokens(rds, c, "r0", 2)
    assert queued.cancel() == "cancelled"
    for j in running:
        assert j.cancel() in ("cancelling", "cancelled")
    for j in running:
        res = j.result(timeout=30)
        assert res.status == "cancelled" and res.finish_reason == "cancelled" and len(res.token_ids) < 2000
        evs = list(j.stream(timeout=5))
        assert evs[-1].type == "cancelled" and [t for e in evs[:-1] for t in e.token_ids] == res.token_ids
    res = queued.result(timeout=5)
    assert res.status == "cancelled" and res.token_ids == [] and res.timings.started_at is None
    time.sleep(0.5)
    assert not inproc.has_unfinished_requests()
    assert inproc.num_free_blocks == inproc.num_total_blocks
    assert rds.xlen(c.keys.jobs) == 0


@pytest.mark.slow
def test_expiry_queued_and_running(redis_url, queue, rds, inproc):
    c = Client(redis_url, queue=queue)
    # Four long jobs fill the batch past their deadline; the fifth expires while it waits behind them.
    longs = c.submit_many([{"id": f"long{i}", "prompt": "runs past its deadline", "max_tokens": 2000,
                            "ignore_eos": True, "timeout_s": 1.5} for i in range(4)])
    stale = c.submit(id="stale", prompt="waits too long", max_tokens=4, timeout_s=0.5)
    for long in longs:
        res = long.result(timeout=30)
        assert res.status == "expired" and res.finish_reason == "expired" and 0 < len(res.token_ids) < 2000
        assert res.timings.finished_at - res.timings.enqueued_at < 3
        assert res.error.type == "expired" and "deadline (timeout_s=1.5 from enqueue) passed while it ran" in \
            res.error.message
    res = stale.result(timeout=30)
    assert res.status == "expired" and res.token_ids == []
    assert "passed before it started" in res.error.message
    ok = c.submit(prompt="fine", max_tokens=3, timeout_s=60).result(timeout=30)
    assert ok.status == "completed"
    time.sleep(0.5)
    assert inproc.num_free_blocks == inproc.num_total_blocks
