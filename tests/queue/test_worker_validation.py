"""Bad jobs get a failed result with a clear error, are acked, and the worker goes on."""

import json
import time

from producer import Client

# (id, raw "job" field, error type, words the message must hold)
BAD = [
    ("bad-json", "{not json", "invalid_json", "not valid JSON"),
    ("bad-schema", json.dumps({"id": "bad-schema", "prompt": "x", "temperature": "hot"}), "invalid_request",
     "temperature"),
    ("no-prompt", json.dumps({"id": "no-prompt", "max_tokens": 4}), "invalid_request", "prompt or messages"),
    ("typo", json.dumps({"id": "typo", "prompt": "x", "max_token": 4}), "invalid_request", "max_token"),
    ("unknown-model", json.dumps({"id": "unknown-model", "prompt": "x", "model": "gpt-9"}), "unknown_model",
     "gpt-9"),
    ("too-long", json.dumps({"id": "too-long", "prompt": "hello " * 400}), "prompt_too_long", "tokens"),
    ("zero-tokens", json.dumps({"id": "zero-tokens", "prompt": "x", "max_tokens": 0}), "invalid_request",
     "max_tokens"),
    ("over-limit", json.dumps({"id": "over-limit", "prompt": "x", "max_tokens": 1000}), "limit_exceeded",
     "max_tokens"),
    ("bad-message", json.dumps({"id": "bad-message", "messages": [{"role": "user"}]}), "invalid_request",
     "content"),
    ("other-id", json.dumps({"id": "not-this", "prompt": "x"}), "invalid_request", "differs"),
    # JSON may spell a lone surrogate; no text may hold one (issue 38: it stopped a batch in `validating`).
    ("surrogate", json.dumps({"id": "surrogate", "prompt": "\ud800"}), "invalid_request",
     "prompt: text is not valid Unicode"),
    ("surrogate-message", json.dumps({"messages": [{"role": "user", "content": "a\udfffb"}]}), "invalid_request",
     "messages[0].content: text is not valid Unicode"),
    # Past what this worker's engine can ever run: refused at once, naming the field, never parked.
    ("stop-id", json.dumps({"prompt": "x", "stop_token_ids": [49152]}), "invalid_request",
     "stop_token_ids: 49152 is not a token of this model"),
    ("too-wide", json.dumps({"prompt": "x", "n": 4, "best_of": 24}), "invalid_request",
     "best_of is 24: this engine runs at most 16 sequences"),
    ("too-many-blocks", json.dumps({"prompt": "x", "n": 12, "max_tokens": 200}), "invalid_request",
     "its continuations may need 96 KV blocks, and this engine's cache holds 64"),
]


def test_bad_jobs_fail_clearly_then_a_good_job_completes(redis_url, queue, rds, pq_tiny_model, start_worker):
    c = Client(redis_url, queue=queue)
    for job_id, raw, _, _ in BAD:  # a producer that skips the client's checks
        rds.xadd(c.keys.jobs, {"id": job_id, "job": raw})
    rds.xadd(c.keys.jobs, {"id": "no-job-field"})
    c.submit(id="too-late", prompt="x", timeout_s=0.01)  # its deadline passes before any worker starts
    start_worker(queue, pq_tiny_model, "--max-model-len", "128", "--num-kv-blocks", "64", "--max-num-seqs", "16",
                 "--max-tokens-limit", "300", "--served-model-name", "tiny")
    # These jobs have no job record until the worker adopts their entries: wait for that first.
    end = time.monotonic() + 120
    while not rds.exists(c.keys.result("no-job-field")) and time.monotonic() < end:
        time.sleep(0.1)
    for job_id, _, err_type, words in BAD:
        res = c.result(job_id, timeout=10)
        assert res.status == "failed" and res.finish_reason == "error", job_id
        assert res.error.type == err_type, (job_id, res.error)
        assert words in res.error.message, (job_id, res.error.message)
        events = list(c.job(job_id).stream(timeout=5))
        assert [e.type for e in events] == ["error"] and events[0].result == res
    res = c.result("no-job-field", timeout=30)
    assert res.status == "failed" and "'job' field" in res.error.message

    res = c.result("too-late", timeout=10)
    assert (res.status, res.finish_reason) == ("expired", "expired")

    good = c.submit(prompt="Hello", max_tokens=5, temperature=0, model="tiny")
    assert good.result(timeout=60).status == "completed"
    assert rds.xpending(c.keys.jobs, "workers")["pending"] == 0
    assert rds.xlen(c.keys.jobs) == 0
