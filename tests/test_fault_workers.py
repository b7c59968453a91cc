"""Fault tests with real worker processes: SIGKILL, SIGSTOP past the lease, SIGTERM drain. No job is lost,
none runs twice into its stream, and every result equals an undisturbed run."""

import os
import signal
import time

import pytest

from producer import Client, JobRequest

LEASE_MS = 1500
FLAGS = ("--max-num-seqs", "16", "--num-kv-blocks", "512", "--max-model-len", "256", "--lease-ms", str(LEASE_MS))

pytestmark = pytest.mark.slow


def make_requests(n: int, tag: str, max_tokens: int) -> list[JobRequest]:
    out = []
    for i in range(n):
        # Greedy, seeded sampling, and sampling without a seed (the worker derives one from the id).
        temp, seed = [(0, None), (0.8, 1000 + i), (0.8, None)][i % 3]
        out.append(JobRequest(id=f"{tag}-{i}", prompt=f"Job {i} says", max_tokens=max_tokens, ignore_eos=True,
                              temperature=temp, seed=seed))
    return out


def wait_for(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def consumers(rds, c) -> dict:
    try:
        return {x["name"]: x["pending"] for x in rds.xinfo_consumers(c.keys.jobs, "workers")}
    except Exception:
        return {}


def pending_of(rds, c, pid: int) -> int:
    return sum(n for name, n in consumers(rds, c).items() if f"-{pid}-" in name)


def started(p) -> bool:
    # Redis 6.2 lists a consumer only once it has read something: the worker's log says when it is ready.
    return " on queue " in log_of(p)


def check_all(c, reqs, results, pq_reference, pq_check_stream) -> dict:
    assert len(results) == len(reqs)
    assert all(r.status == "completed" for r in results), [(r.id, r.status, r.error) for r in results
                                                           if r.status != "completed"]
    for r in results:
        pq_check_stream(c, r)
    ref = pq_reference(reqs)
    assert [r.token_ids for r in results] == [x[0] for x in ref]
    assert [r.text for r in results] == [x[1] for x in ref]
    return {"in": len(reqs), "out": len(results), "resumed": sum(r.attempts > 1 for r in results)}


def log_of(p) -> str:
    with open(p.log.name) as f:
        return f.read()


def test_sigkill_one_of_two_workers(redis_url, queue, rds, pq_tiny_model, start_worker, pq_reference,
                                    pq_check_stream):
    c = Client(redis_url, queue=queue)
    a = start_worker(queue, pq_tiny_model, *FLAGS)
    b = start_worker(queue, pq_tiny_model, *FLAGS)
    wait_for(lambda: started(a) and started(b), 120, "both workers")
    reqs = make_requests(200, "k", 16)
    jobs = c.submit_many(reqs)
    # Kill A while it holds jobs that have streamed part of their tokens.
    wait_for(lambda: pending_of(rds, c, a.pid) >= 4 and rds.exists(c.keys.result("k-20")), 120, "A busy")
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    results = [j.result(timeout=240) for j in jobs]
    stats = check_all(c, reqs, results, pq_reference, pq_check_stream)
    assert stats["resumed"] >= 1  # A's jobs finished on B
    assert any(r.attempts > 1 and rds.xlen(c.keys.events(r.id)) > 1 for r in results)
    assert rds.xlen(c.keys.jobs) == 0 and rds.xpending(c.keys.jobs, "workers")["pending"] == 0
    print("sigkill", stats)


def test_sigstop_past_the_lease(redis_url, queue, rds, pq_tiny_model, start_worker, pq_reference,
                                pq_check_stream):
    c = Client(redis_url, queue=queue)
    a = start_worker(queue, pq_tiny_model, *FLAGS)
    reqs = make_requests(24, "p", 48)
    jobs = c.submit_many(reqs)
    wait_for(lambda: rds.xlen(c.keys.events("p-0")) >= 3, 120, "A streaming")
    os.kill(a.pid, signal.SIGSTOP)
    try:
        b = start_worker(queue, pq_tiny_model, *FLAGS)
        results = [j.result(timeout=240) for j in jobs]
    finally:
        os.kill(a.pid, signal.SIGCONT)
    # A wakes up holding leases that are gone: its next writes are refused and it drops those jobs.
    wait_for(lambda: "lease lost" in log_of(a), 30, "A to notice its lost leases")
    time.sleep(LEASE_MS / 1000)
    assert a.poll() is None and b.poll() is None  # both still up
    stats = check_all(c, reqs, results, pq_reference, pq_check_stream)
    assert stats["resumed"] >= 1
    assert all(r.worker and f"-{b.pid}-" in r.worker for r in results if r.attempts > 1)
    print("sigstop", stats)


def test_sigterm_drain_hands_back(redis_url, queue, rds, pq_tiny_model, start_worker, pq_reference,
                                  pq_check_stream):
    c = Client(redis_url, queue=queue)
    a = start_worker(queue, pq_tiny_model, *FLAGS, "--drain-timeout", "0.2")
    b = start_worker(queue, pq_tiny_model, *FLAGS)
    wait_for(lambda: started(a) and started(b), 120, "both workers")
    reqs = make_requests(48, "d", 48)
    jobs = c.submit_many(reqs)
    wait_for(lambda: pending_of(rds, c, a.pid) >= 4 and rds.xlen(c.keys.events("d-0")) >= 2, 120, "A busy")
    os.kill(a.pid, signal.SIGTERM)
    assert a.wait(30) == 0
    assert "handing" in log_of(a) or "unfinished" not in log_of(a)
    results = [j.result(timeout=240) for j in jobs]
    stats = check_all(c, reqs, results, pq_reference, pq_check_stream)
    assert stats["resumed"] >= 1
    print("sigterm", stats)

    # A second signal exits at once, without waiting for the drain.
    jobs = c.submit_many([{"prompt": f"long {i}", "max_tokens": 200, "ignore_eos": True} for i in range(8)])
    wait_for(lambda: pending_of(rds, c, b.pid) >= 1, 60, "B busy")
    os.kill(b.pid, signal.SIGTERM)
    time.sleep(0.1)
    os.kill(b.pid, signal.SIGTERM)
    t = time.monotonic()
    b.wait(10)
    assert time.monotonic() - t < 5
