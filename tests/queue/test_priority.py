"""Priority at the queue, end to end on one worker with a tiny model: urgent lanes first, groups by weight, a
running job preempted for an urgent one with nothing lost or repeated, even when its worker is killed then."""

from __future__ import annotations

import signal
import threading
from collections import Counter

import pytest
from faults import wait_for
from preemptions import record_preemptions

from monitor.fleet import live_workers
from producer import Client, JobRequest
from producer.groups import GroupSettings, set_group

FLAGS = ("--max-num-seqs", "4", "--num-kv-blocks", "256", "--max-model-len", "256", "--heartbeat-s", "0.5",
         "--lease-ms", "2000")


@pytest.fixture
def inproc(redis_url, queue, pq_tiny_model):
    """start(max_num_seqs) -> an in-process worker's engine (the worker runs in a thread until the test ends)."""
    from engine import EngineConfig, LLMEngine
    from worker.worker import Worker, WorkerConfig

    workers = []

    def start(max_num_seqs: int = 8):
        eng = LLMEngine(EngineConfig(model=pq_tiny_model, max_num_seqs=max_num_seqs, num_kv_blocks=1024,
                                     max_model_len=256))
        w = Worker(eng, WorkerConfig(redis_url=redis_url, queue=queue, lease_ms=5000, block_ms=200))
        t = threading.Thread(target=w.run, daemon=True)
        workers.append((w, t))
        return eng, t

    yield start
    for w, t in workers:
        w.stop()
        t.join(60)


def _jobs(n: int, prefix: str, **fields) -> list[JobRequest]:
    return [JobRequest(id=f"{prefix}{i}", prompt=f"{prefix} {i}", temperature=0, ignore_eos=True, **fields)
            for i in range(n)]


@pytest.mark.slow
def test_interactive_jobs_go_before_a_queued_batch(redis_url, queue, inproc):
    eng, thread = inproc(max_num_seqs=8)
    preempted = record_preemptions(eng)
    c = Client(redis_url, queue=queue)
    batch = c.submit_many(_jobs(500, "b", lane="batch", max_tokens=24))
    thread.start()
    wait_for(lambda: sum(j.status() == "completed" for j in batch[:16]) >= 8, 120, "the batch under way")
    urgent = [c.submit(r) for r in _jobs(10, "i", lane="interactive", max_tokens=4)]
    results = [j.result(timeout=120) for j in urgent]
    started = {r.id: r.timings.started_at for r in results}
    batch_started = sorted(s for j in batch if (s := c.redis.hget(c.keys.job(j.id), "started_at")))
    for r in results:
        # Batch jobs started between its submit and its start: at most the floor's one (of --lane-floor 10).
        between = [s for s in map(float, batch_started) if r.timings.enqueued_at < s < started[r.id]]
        assert len(between) <= 1, (r.id, len(between))
    # The batch was full: the interactive jobs got in by preempting batch jobs, not by waiting for them to end.
    assert preempted and all(p.startswith("b") for p in preempted)
    assert all(r.status == "completed" and len(r.token_ids) == 4 for r in results)


@pytest.mark.slow
def test_groups_share_by_weight_and_a_small_group_is_not_held_back(redis_url, queue, rds, inproc):
    from producer.keys import Keys

    eng, thread = inproc(max_num_seqs=6)
    c = Client(redis_url, queue=queue)
    for name, weight in (("g1", 1), ("g2", 2), ("g4", 4)):
        set_group(rds, Keys(queue), name, GroupSettings(weight=weight))
    jobs = []
    for name in ("g1", "g2", "g4"):
        jobs += c.submit_many(_jobs(300, f"{name}-", group=name, max_tokens=3))
    thread.start()
    results = [j.result(timeout=600) for j in jobs]
    first_half = sorted(results, key=lambda r: r.timings.finished_at)[:450]
    tokens = Counter()
    for r in first_half:
        tokens[r.id.split("-")[0]] += len(r.token_ids)
    total = sum(tokens.values())
    for name, weight in (("g1", 1), ("g2", 2), ("g4", 4)):
        share = tokens[name] / total
        assert abs(share - weight / 7) <= 0.1 * weight / 7, (name, share, tokens)


@pytest.mark.slow
def test_a_group_with_five_jobs_is_not_held_back_by_one_with_2000(redis_url, queue, inproc):
    eng, thread = inproc(max_num_seqs=8)
    c = Client(redis_url, queue=queue)
    big = c.submit_many(_jobs(2000, "big-", group="big", max_tokens=3))
    thread.start()
    wait_for(lambda: big[20].status() == "completed", 120, "the big group under way")
    small = c.submit_many(_jobs(5, "small-", group="small", max_tokens=3))
    done = max(j.result(timeout=120).timings.finished_at for j in small)
    after = [j for j in big if (s := c.redis.hget(c.keys.job(j.id), "started_at")) and
             float(s) > small[0].result().timings.enqueued_at]
    started_before = [j for j in after if float(c.redis.hget(c.keys.job(j.id), "started_at")) < done]
    assert len(started_before) < 50, len(started_before)


def test_preempted_jobs_finish_as_undisturbed_ones_even_when_their_worker_is_killed(
        redis_url, queue, start_worker, pq_tiny_model, pq_reference, pq_check_stream):
    c = Client(redis_url, queue=queue)
    low = _jobs(2, "low-", lane="batch", max_tokens=60)
    low += [JobRequest(id=f"low-s{i}", prompt=f"sampled {i}", temperature=0.9, seed=7 + i, ignore_eos=True,
                       lane="batch", max_tokens=60) for i in range(2)]
    slow = start_worker(queue, pq_tiny_model, *FLAGS, hooks={"step-delay-ms": 40})
    low_jobs = c.submit_many(low)
    wait_for(lambda: all(c.redis.xlen(c.keys.events(j.id)) >= 3 for j in low_jobs), 120, "a full batch running")
    urgent = c.submit_many(_jobs(2, "urgent-", lane="interactive", max_tokens=40))
    # The urgent jobs run, the batch jobs they displaced wait in the engine (preempted): kill the worker then.
    wait_for(lambda: all(c.redis.xlen(c.keys.events(j.id)) >= 2 for j in urgent), 60, "the urgent jobs running")
    wait_for(lambda: any(w["waiting"] for w in live_workers(c.redis, c.keys)), 30, "batch jobs preempted, waiting")
    slow.send_signal(signal.SIGKILL)
    slow.wait(30)
    start_worker(queue, pq_tiny_model, *FLAGS)
    results = [j.result(timeout=180) for j in low_jobs + urgent]
    reference = pq_reference(low + _jobs(2, "urgent-", lane="interactive", max_tokens=40))
    for r, (ids, text) in zip(results, reference, strict=True):
        assert r.status == "completed" and (r.token_ids, r.text) == (ids, text), r.id
        pq_check_stream(c, r)
    assert max(r.attempts for r in results) == 2  # every one was resumed by the second worker


def test_no_preemption_when_turned_off(redis_url, queue, pq_tiny_model, start_worker):
    c = Client(redis_url, queue=queue)
    start_worker(queue, pq_tiny_model, *FLAGS, "--no-preempt-for-priority", hooks={"step-delay-ms": 20})
    low = c.submit_many(_jobs(4, "low-", lane="batch", max_tokens=100))  # seconds left when it comes
    wait_for(lambda: all(c.redis.xlen(c.keys.events(j.id)) >= 2 for j in low), 120, "a full batch running")
    urgent = c.submit(_jobs(1, "urgent-", lane="interactive", max_tokens=4)[0]).result(timeout=120)
    # It waited for a batch job to end: no batch job was interrupted.
    assert urgent.timings.started_at >= min(j.result(timeout=60).timings.finished_at for j in low) - 0.5
