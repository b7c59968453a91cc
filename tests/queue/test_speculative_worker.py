"""A worker started with --speculative ngram: greedy jobs come out as an engine without speculation makes them, and
their event streams hold each token once, in order, however many a step lands."""

import os
import re
import signal

import httpx
from faults import check_all, make_requests, started, streaming_on, wait_for

from producer import Client
from producer.protocol import JobRequest
from worker.redis_server import free_port

PROMPTS = ["the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat",
           " ".join(str(i % 5) for i in range(40)), "Hello there, how are you?"]


def test_worker_speculates_and_changes_nothing(redis_url, queue, pq_tiny_model, start_worker, pq_reference,
                                               pq_check_stream):
    port = free_port()
    worker = start_worker(queue, pq_tiny_model, "--speculative", "ngram", "--num-speculative-tokens", "3",
                          "--max-num-seqs", "4", "--num-kv-blocks", "256", "--max-model-len", "256",
                          "--metrics-port", str(port))
    reqs = [JobRequest(id=f"spec-{i}", prompt=p, max_tokens=40, temperature=0) for i, p in enumerate(PROMPTS)]
    reqs.append(JobRequest(id="spec-sampled", prompt=PROMPTS[0], max_tokens=20, temperature=0.8, seed=5))
    with Client(redis_url, queue=queue) as client:
        jobs = client.submit_many(reqs)
        results = [j.result(timeout=180) for j in jobs]
        want = pq_reference(reqs)
        for res, (ids, text) in zip(results, want):
            assert res.status == "completed", res
            assert (res.token_ids, res.text) == (ids, text), res.id
            pq_check_stream(client, res)
    assert "speculative decoding: ngram, up to 3 draft tokens" in worker.output()
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    counts = {name: float(re.search(rf"^pagedq_speculative_{name}_tokens_total{{[^}}]*}} (\S+)$", text, re.M)[1])
              for name in ("proposed", "accepted")}
    assert 0 < counts["accepted"] <= counts["proposed"], counts


def test_sigkill_mid_job_resumes_exactly(redis_url, queue, rds, pq_tiny_model, start_worker, pq_reference,
                                         pq_check_stream):
    """Two speculating workers, one SIGKILLed while it streams: its jobs (greedy, seeded and unseeded sampling)
    finish on the other as an undisturbed run makes them, no stream token twice."""
    flags = ("--speculative", "ngram", "--max-num-seqs", "4", "--num-kv-blocks", "256", "--max-model-len", "256",
             "--lease-ms", "1500")
    c = Client(redis_url, queue=queue)
    a = start_worker(queue, pq_tiny_model, *flags)
    b = start_worker(queue, pq_tiny_model, *flags)
    wait_for(lambda: started(a) and started(b), 120, "both workers")
    reqs = make_requests(24, "spec-kill", 40)
    jobs = c.submit_many(reqs)
    wait_for(lambda: streaming_on(rds, c, a.pid, reqs), 240, "A streaming")
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    results = [j.result(timeout=240) for j in jobs]
    stats = check_all(c, reqs, results, pq_reference, pq_check_stream)
    assert stats["resumed"] >= 1
