"""The smallest producer: a bare XADD of the documented fields (PROTOCOL.md), as a producer in any language
would write it, without the Python client. The job runs, and the Python client reads its result and stream.
Such a job has no job record until a worker takes its entry (submit.lua writes one at once): until then a
client does not know it."""

import json

from faults import wait_for

from producer import Client


def test_bare_xadd_jobs_run(redis_url, queue, rds, pq_tiny_model, start_worker):
    c = Client(redis_url, queue=queue)
    job = {"prompt": "Hello from elsewhere", "max_tokens": 5, "temperature": 0}
    rds.xadd(c.keys.jobs, {"id": "ext-1", "job": json.dumps(job)})  # no id inside the JSON
    rds.xadd(c.keys.jobs, {"id": "ext-2", "job": json.dumps({**job, "id": None})})  # a null id, the same
    rds.xadd(c.keys.jobs, {"id": "ext-3", "job": json.dumps({**job, "id": "ext-3"})})  # both, equal
    bare = rds.xadd(c.keys.jobs, {"job": json.dumps(job)})  # no id at all: the entry id names the job
    start_worker(queue, pq_tiny_model, "--max-model-len", "128", "--num-kv-blocks", "64")
    for job_id in ("ext-1", "ext-2", "ext-3", bare):
        wait_for(lambda job_id=job_id: rds.exists(c.keys.job(job_id)), 120, f"a worker to take {job_id}")
        res = c.result(job_id, timeout=120)
        assert res.status == "completed" and res.id == job_id, (job_id, res.error)
        assert res.usage.completion_tokens == 5
        events = list(c.job(job_id).stream(timeout=10))
        assert "".join(e.text for e in events[:-1]) == res.text and events[-1].type == "done"
    assert rds.xlen(c.keys.jobs) == 0
