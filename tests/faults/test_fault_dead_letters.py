"""A poison job (it fails in the worker on every delivery, through tests/worker_hooks.py) reaches the dead-letter stream
after max_attempts deliveries; the other jobs are unaffected; `pagedq dlq list | retry | purge` work."""

import json

import pytest
from click.testing import CliRunner

from cli import main
from producer import Client

pytestmark = pytest.mark.slow


def cli(redis_url, queue, *args):
    return CliRunner().invoke(main, list(args), env={"REDIS_URL": redis_url, "PAGEDQ_QUEUE": queue})


def test_poison_job_dead_letters(redis_url, queue, rds, pq_tiny_model, start_worker):
    c = Client(redis_url, queue=queue)
    good = c.submit_many([{"id": f"g{i}", "prompt": f"fine {i}", "max_tokens": 6, "temperature": 0}
                          for i in range(10)])
    poison = c.submit(id="poison", prompt="this one is POISON", max_tokens=6)
    start_worker(queue, pq_tiny_model, "--max-num-seqs", "8", "--num-kv-blocks", "128", "--max-model-len", "256",
                 "--max-attempts", "3", "--lease-ms", "1500", hooks={"poison": "POISON"})
    res = poison.result(timeout=120)
    assert res.status == "failed" and res.error.type == "worker_error" and res.attempts == 3
    assert "poison" in res.error.message
    assert all(j.result(timeout=120).status == "completed" for j in good)
    assert [e.type for e in poison.stream(timeout=5)] == ["error"]

    out = cli(redis_url, queue, "dlq", "list", "--json")
    dead = json.loads(out.output)
    assert [d["id"] for d in dead] == ["poison"] and dead[0]["attempts"] == "3"
    assert json.loads(dead[0]["job"])["prompt"] == "this one is POISON"
    assert "poison" in cli(redis_url, queue, "dlq", "list").output

    # Retry: it runs afresh (and, still poison, comes back after 3 more deliveries).
    old = dead[0]["entry"]
    assert cli(redis_url, queue, "dlq", "retry", "poison").exit_code == 0
    res = c.result("poison", timeout=120)
    assert res.status == "failed" and res.attempts == 3
    assert [eid for eid, _ in rds.xrange(c.keys.dlq)] != [old] and rds.xlen(c.keys.dlq) == 1
    assert cli(redis_url, queue, "dlq", "retry", "nope").exit_code != 0
    assert "purged 1" in cli(redis_url, queue, "dlq", "purge").output
    assert rds.xlen(c.keys.dlq) == 0 and rds.xlen(c.keys.jobs) == 0


def test_job_that_kills_its_worker_dead_letters(redis_url, queue, rds, pq_tiny_model, start_worker,
                                                pq_check_stream):
    """A job whose worker is SIGKILLed on every delivery (an OOM-killer victim): after max_attempts deliveries
    the next worker dead-letters it, and the queue's other jobs finish, each exactly once."""
    c = Client(redis_url, queue=queue)
    good = c.submit_many([{"id": f"g{i}", "prompt": f"fine {i}", "max_tokens": 8, "temperature": 0}
                          for i in range(12)])
    killer = c.submit(id="killer", prompt="this one is CRASH", max_tokens=64, ignore_eos=True)
    flags = ("--max-num-seqs", "8", "--num-kv-blocks", "128", "--max-model-len", "256", "--max-attempts", "3",
             "--lease-ms", "1500")
    for delivery in (1, 2, 3):
        w = start_worker(queue, pq_tiny_model, *flags, hooks={"crash": "CRASH"})
        assert w.wait(timeout=300) == -9  # it took the job, streamed a token, and was killed
        assert rds.hget(c.keys.job("killer"), "attempts") == str(delivery)
        assert rds.hget(c.keys.job("killer"), "state") == "running"
    # The next worker (it too would die running it) dead-letters the job instead, and serves the rest.
    survivor = start_worker(queue, pq_tiny_model, *flags, hooks={"crash": "CRASH"})
    res = killer.result(timeout=300)
    assert res.status == "failed" and res.finish_reason == "error" and res.attempts == 3
    assert res.error.type == "max_attempts" and "3 times" in res.error.message
    assert [e.type for e in killer.stream(timeout=5)][-1] == "error"
    dead = rds.xrange(c.keys.dlq)
    assert [f["id"] for _, f in dead] == ["killer"] and dead[0][1]["error"] == "max_attempts"
    assert json.loads(dead[0][1]["job"])["prompt"] == "this one is CRASH"

    results = [j.result(timeout=300) for j in good]
    assert [r.status for r in results] == ["completed"] * len(good)
    for r in results:
        pq_check_stream(c, r)  # every token once, one terminal event: nothing duplicated or lost
    assert rds.xlen(c.keys.jobs) == 0 and rds.xpending(c.keys.jobs, "workers")["pending"] == 0
    assert survivor.poll() is None
    print("crash loop", {"in": len(good) + 1, "completed": len(results), "dead-lettered": 1})
