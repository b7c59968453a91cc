"""Fault tests with real worker processes: SIGKILL, SIGSTOP past the lease, SIGTERM drain. No job is lost,
none runs twice into its stream, and every result equals an undisturbed run."""

import os
import signal
import time

import pytest
from faults import check_all, log_of, make_requests, started, streaming_on, wait_for

from producer import Client

LEASE_MS = 1500
FLAGS = ("--max-num-seqs", "16", "--num-kv-blocks", "512", "--max-model-len", "256", "--lease-ms", str(LEASE_MS))

pytestmark = pytest.mark.slow


def test_sigkill_one_of_two_workers(redis_url, queue, rds, pq_tiny_model, start_worker, pq_reference,
                                    pq_check_stream):
    c = Client(redis_url, queue=queue)
    a = start_worker(queue, pq_tiny_model, *FLAGS)
    b = start_worker(queue, pq_tiny_model, *FLAGS)
    wait_for(lambda: started(a) and started(b), 120, "both workers")
    reqs = make_requests(200, "k", 16)
    jobs = c.submit_many(reqs)
    # Kill A while it runs jobs that have streamed part of their tokens (a state, not a count: on a busy
    # machine A may have read many jobs and started none yet).
    wait_for(lambda: streaming_on(rds, c, a.pid, reqs), 240, "A streaming")
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
    wait_for(lambda: streaming_on(rds, c, a.pid, reqs), 240, "A streaming")
    os.kill(a.pid, signal.SIGTERM)
    assert a.wait(30) == 0
    assert "handing" in log_of(a) or "unfinished" not in log_of(a)
    results = [j.result(timeout=240) for j in jobs]
    stats = check_all(c, reqs, results, pq_reference, pq_check_stream)
    assert stats["resumed"] >= 1
    print("sigterm", stats)

    # A second signal exits at once, without waiting for the drain.
    jobs = c.submit_many([{"prompt": f"long {i}", "max_tokens": 200, "ignore_eos": True} for i in range(8)])
    wait_for(lambda: streaming_on(rds, c, b.pid, jobs), 120, "B streaming")
    os.kill(b.pid, signal.SIGTERM)
    wait_for(lambda: "finishing running jobs" in log_of(b), 60, "B to start draining")
    os.kill(b.pid, signal.SIGTERM)
    # Exit code 1 and the log line: it quit on the second signal, not after a drain (which exits 0).
    assert b.wait(60) == 1
    assert "again: exiting at once" in log_of(b)
