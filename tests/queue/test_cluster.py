"""pagedq on a real Redis Cluster (three masters): two queues whose slots live on different masters, a worker
each, the clients and the CLI pointed at the third node by a plain redis:// URL. Submit, submit_many, stream,
cancel, the asyncio client, and a SIGKILL resume."""

import asyncio
import json
import os
import signal

import pytest
from click.testing import CliRunner
from faults import check_all, make_requests, spread_lanes, started, streaming_on, wait_for
from redis.cluster import RedisCluster

from cli import main
from producer import AsyncClient, Client
from producer.connection import is_cluster
from producer.queue_info import queue_info

pytestmark = pytest.mark.slow

FLAGS = ("--max-num-seqs", "16", "--num-kv-blocks", "512", "--max-model-len", "256", "--lease-ms", "1500")


@pytest.fixture
def layout(redis_cluster, cluster_queues):
    """(queue A, queue B, A's master, B's master, a third node that holds neither)."""
    qa, qb = cluster_queues
    na, nb = redis_cluster.queue_node(qa), redis_cluster.queue_node(qb)
    (third,) = [u for u in redis_cluster.urls if u not in (na, nb)]
    return qa, qb, na, nb, third


def cli(url: str, queue: str, *args: str):
    return CliRunner().invoke(main, list(args), env={"REDIS_URL": url, "PAGEDQ_QUEUE": queue})


def test_two_queues_on_two_masters(layout, pq_tiny_model, start_worker, pq_reference, pq_check_stream):
    qa, qb, na, nb, third = layout
    # Each worker is pointed at a node that does not hold its queue: the cluster client routes by slot.
    wa = start_worker(qa, pq_tiny_model, *FLAGS, url=nb)
    wb = start_worker(qb, pq_tiny_model, *FLAGS, url=na)
    ca, cb = Client(third, queue=qa), Client(third, queue=qb)
    assert is_cluster(ca.redis)

    reqs_a, reqs_b = make_requests(12, "a", 12), make_requests(12, "b", 12)
    jobs_a, jobs_b = ca.submit_many(reqs_a), cb.submit_many(reqs_b)
    one = cb.submit(prompt="Streaming on a cluster", max_tokens=10, temperature=0)
    events = list(one.stream(timeout=120))
    assert events[-1].type == "done" and "".join(e.text for e in events[:-1]) == events[-1].result.text

    res_a = [j.result(timeout=180) for j in jobs_a]
    res_b = [j.result(timeout=180) for j in jobs_b]
    check_all(ca, reqs_a, res_a, pq_reference, pq_check_stream)
    check_all(cb, reqs_b, res_b, pq_reference, pq_check_stream)
    assert {f"-{wa.pid}-" in r.worker for r in res_a} == {True}
    assert {f"-{wb.pid}-" in r.worker for r in res_b} == {True}

    # Cancel: a running job stops at its worker's next step.
    long = ca.submit(prompt="long", max_tokens=200, ignore_eos=True)
    wait_for(lambda: ca.redis.exists(ca.keys.events(long.id)), 120, "the long job streaming")
    assert long.cancel() in ("cancelling", "completed")
    assert long.result(timeout=120).status in ("cancelled", "completed")

    async def via_asyncio():
        async with AsyncClient(third, queue=qb) as ac:
            job = await ac.submit(prompt="async on a cluster", max_tokens=6, temperature=0)
            res = await job.result(timeout=120)
            return res, [e.type async for e in job.stream(timeout=30)]

    res, types = asyncio.run(via_asyncio())
    assert res.status == "completed" and types[-1] == "done"

    # The CLI with any node's URL.
    out = cli(third, qa, "submit", "From the CLI", "--max-tokens", "5", "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["status"] == "completed"
    out = cli(third, qa, "status", "--json")
    assert out.exit_code == 0 and json.loads(out.output)["queue"] == qa
    out = cli(third, qa, "dlq", "list", "--json")
    assert out.exit_code == 0 and json.loads(out.output) == []
    # A client built by the caller from redis-py's own cluster class.
    with Client(redis=RedisCluster.from_url(third, decode_responses=True), queue=qa) as own:
        assert own.status(jobs_a[0].id) == "completed"
    queued = cli(nb, "nobody-serves-this", "submit", "queued", "--no-wait")
    assert cli(nb, "nobody-serves-this", "cancel", queued.output.strip()).output.strip() == "cancelled"


def test_sigkill_resume_on_a_cluster(layout, pq_tiny_model, start_worker, pq_reference, pq_check_stream):
    qa, _, na, nb, third = layout
    c = Client(third, queue=qa)
    # Slowed down, so that jobs are still running when it is killed (else it may finish them all first).
    a = start_worker(qa, pq_tiny_model, *FLAGS, url=nb, hooks={"step-delay-ms": 20})
    wait_for(lambda: started(a), 120, "worker A")
    reqs = spread_lanes(make_requests(32, "k", 24))
    jobs = c.submit_many(reqs)
    wait_for(lambda: streaming_on(c.redis, c, a.pid, reqs), 240, "A streaming")
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    b = start_worker(qa, pq_tiny_model, *FLAGS, url=na)
    results = [j.result(timeout=240) for j in jobs]
    stats = check_all(c, reqs, results, pq_reference, pq_check_stream)
    assert stats["resumed"] >= 1
    assert all(f"-{b.pid}-" in r.worker for r in results if r.attempts > 1)
    assert queue_info(c.redis, c.keys)["length"] == 0  # every lane's and group's stream
    print("cluster sigkill", stats)
