"""A poison job (it fails in the worker on every delivery, through a test hook) reaches the dead-letter stream
after max_attempts deliveries; the other jobs are unaffected; `pagedq dlq list | retry | purge` work."""

import json

import pytest
from click.testing import CliRunner

from producer import Client
from worker.cli import main

pytestmark = pytest.mark.slow


def cli(redis_url, queue, *args):
    return CliRunner().invoke(main, list(args), env={"REDIS_URL": redis_url, "PAGEDQ_QUEUE": queue})


def test_poison_job_dead_letters(redis_url, queue, rds, pq_tiny_model, start_worker):
    c = Client(redis_url, queue=queue)
    good = c.submit_many([{"id": f"g{i}", "prompt": f"fine {i}", "max_tokens": 6, "temperature": 0}
                          for i in range(10)])
    poison = c.submit(id="poison", prompt="this one is POISON", max_tokens=6)
    start_worker(queue, pq_tiny_model, "--max-num-seqs", "8", "--num-kv-blocks", "128", "--max-model-len", "256",
                 "--max-attempts", "3", "--lease-ms", "1500", env={"PAGEDQ_FAULT_POISON": "POISON"})
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
