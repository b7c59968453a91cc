"""A worker started with --speculative ngram: greedy jobs come out as an engine without speculation makes them, and
their event streams hold each token once, in order, however many a step lands."""

import re

import httpx

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
