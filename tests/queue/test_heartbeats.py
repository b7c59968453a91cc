"""Worker heartbeats: `pagedq status` and `pagedq workers` show live workers, forget dead ones within one TTL,
and dead consumers leave the group without taking a pending job with them."""

import json
import signal
import time

import pytest
from click.testing import CliRunner
from faults import wait_for

from monitor import fleet
from producer import Client
from producer.keys import GROUP, Keys
from worker.consumers import prune_dead_consumers
from worker.heartbeat import Heartbeat
from worker.metrics import Metrics

FLAGS = ("--max-num-seqs", "4", "--num-kv-blocks", "64", "--max-model-len", "256", "--heartbeat-s", "0.5")


def cli(redis_url, queue, *args):
    from cli import main

    return CliRunner().invoke(main, [*args], env={"REDIS_URL": redis_url, "PAGEDQ_QUEUE": queue})


def status_json(redis_url, queue) -> dict:
    res = cli(redis_url, queue, "status", "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_status_shows_live_workers_and_forgets_dead_ones(redis_url, queue, rds, pq_tiny_model, start_worker):
    a = start_worker(queue, pq_tiny_model, *FLAGS, "--worker-id", "hb-a")
    b = start_worker(queue, pq_tiny_model, *FLAGS, "--worker-id", "hb-b")
    info = wait_for(lambda: (i := status_json(redis_url, queue)) and len(i["workers"]) == 2 and i, 120,
                      "two live workers")
    w = {x["id"]: x for x in info["workers"]}["hb-a"]
    assert w["queue"] == queue and w["device"] == "cpu" and w["dtype"] == "float32"
    assert w["kv_blocks_total"] == 64 and w["max_num_seqs"] == 4 and w["version"]
    for field in ("model", "started_at", "running", "waiting", "kv_blocks_used", "tokens_per_s", "last_step_s"):
        assert field in w

    with Client(redis_url, queue=queue) as c:
        jobs = c.submit_many([{"prompt": f"hello {i}", "max_tokens": 6, "temperature": 0} for i in range(4)])
        assert all(j.result(timeout=120).status == "completed" for j in jobs)
    # The workers' stats intervals reach the queue's stats stream: every token is in exactly one interval.
    produced = 4 * 6
    wait_for(lambda: sum(int(f["tokens"]) for _, f in rds.xrange(Keys(queue).stats)) == produced, 30,
               "the generated tokens in the stats stream")

    out = cli(redis_url, queue, "status").output
    assert "2 live workers" in out and "hb-a" in out and "hb-b" in out
    out = cli(redis_url, queue, "workers").output
    assert queue in out and "hb-a" in out and "hb-b" in out

    # Killed: no goodbye. It vanishes within one TTL (1.5 s here) of its last beat.
    a.send_signal(signal.SIGKILL)
    a.wait(30)
    wait_for(lambda: [x["id"] for x in status_json(redis_url, queue)["workers"]] == ["hb-b"], 30,
               "the killed worker to vanish")
    # Its consumer is still in the group (pruning waits a minute of idleness), shown as without a heartbeat.
    assert "consumer hb-a (no heartbeat)" in cli(redis_url, queue, "status").output

    # Stopped cleanly: its record and its consumer go at once.
    b.send_signal(signal.SIGTERM)
    assert b.wait(60) == 0
    info = status_json(redis_url, queue)
    assert info["workers"] == [] and "hb-b" not in [c["name"] for c in info["consumers"]]


def _heartbeat(r, queue: str, worker_id: str, interval: float = 10.0) -> Heartbeat:
    state = {"jobs": 0, "running": 1, "waiting": 0, "kv_blocks_used": 3, "kv_blocks_total": 8}
    return Heartbeat(r, Keys(queue), worker_id, {"model": "m", "device": "cpu"}, interval, Metrics(queue),
                     lambda: state, lease_ms=30_000)


def test_prune_removes_only_idle_consumers_without_pending_or_heartbeat(redis_url, queue, rds):
    k = Keys(queue)
    rds.xgroup_create(k.jobs, GROUP, id="0", mkstream=True)
    rds.xadd(k.jobs, {"id": "j1", "job": "{}"})
    rds.xreadgroup(GROUP, "holds-a-job", {k.jobs: ">"}, count=1)  # pending 1
    rds.xgroup_createconsumer(k.jobs, GROUP, "gone")  # pending 0
    rds.xgroup_createconsumer(k.jobs, GROUP, "alive")
    _heartbeat(rds, queue, "alive").beat()
    assert prune_dead_consumers(rds, k, min_idle_ms=60_000) == []  # all idle less than a minute
    assert prune_dead_consumers(rds, k, min_idle_ms=0) == ["gone"]
    names = {c["name"]: c["pending"] for c in rds.xinfo_consumers(k.jobs, GROUP)}
    assert names == {"holds-a-job": 1, "alive": 0}
    assert rds.xpending(k.jobs, GROUP)["pending"] == 1  # the job is still reclaimable


def test_records_expire_and_queues_are_listed(redis_url, queue, rds):
    other = queue + "-b"
    hb = _heartbeat(rds, queue, "w1", interval=0.4)
    hb.beat()
    _heartbeat(rds, other, "w2").beat()
    assert {queue, other} <= set(fleet.known_queues(rds))
    assert [w["id"] for w in fleet.live_workers(rds, Keys(queue))] == ["w1"]
    rec = fleet.live_workers(rds, Keys(other))[0]
    assert rec["kv_blocks_used"] == 3 and rec["model"] == "m" and rec["queue"] == other
    # No beat for longer than its TTL (3 intervals): gone, though nobody removed it.
    wait_for(lambda: fleet.live_workers(rds, Keys(queue)) == [], 10, "the record's TTL")
    hb.remove()
    assert rds.zscore(Keys(queue).workers, "w1") is None


def test_heartbeats_on_a_cluster(redis_cluster, cluster_queues):
    from producer.connection import connect

    r = connect(redis_cluster.url, decode_responses=True)
    try:
        for i, q in enumerate(cluster_queues):  # queues whose slots live on different masters
            r.xgroup_create(Keys(q).jobs, GROUP, id="0", mkstream=True)
            _heartbeat(r, q, f"cw{i}").beat()
        assert set(cluster_queues) <= set(fleet.all_queues(r))
        for i, q in enumerate(cluster_queues):
            info = fleet.queue_status(r, q)
            assert [w["id"] for w in info["workers"]] == [f"cw{i}"] and info["length"] == 0
    finally:
        r.close()


@pytest.mark.parametrize("args", [("status",), ("workers",)])
def test_status_and_workers_without_redis(args):
    res = cli("redis://127.0.0.1:1/0", "default", *args)
    assert res.exit_code == 3 and "Redis unreachable" in res.output, res.output
    assert "Traceback" not in res.output


def test_status_watch_refreshes(redis_url, queue, monkeypatch):
    # --watch runs until interrupted: stop it on its second sleep and look at what it printed.
    calls = []

    def sleep(s):
        calls.append(s)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", sleep)
    res = cli(redis_url, queue, "status", "--watch", "--json", "--interval", "0.5")
    lines = [json.loads(x) for x in res.output.splitlines() if x.startswith("{")]
    assert len(lines) == 2 and lines[0]["queue"] == queue and calls == [0.5, 0.5]



def test_a_batch_that_starts_or_empties_shows_before_the_next_beat(redis_url, queue, pq_tiny_model, start_worker):
    # Beats a minute apart, waits of at most 30 s: only the beat at the batch's start and end can show them.
    start_worker(queue, pq_tiny_model, "--max-num-seqs", "4", "--num-kv-blocks", "256", "--max-model-len", "2048",
                 "--heartbeat-s", "60", "--lease-ms", "600000", "--worker-id", "hb-idle")
    wait_for(lambda: status_json(redis_url, queue)["workers"], 120, "the worker's first beat")

    def running() -> int:
        return status_json(redis_url, queue)["workers"][0]["running"]

    with Client(redis_url, queue=queue) as c:
        job = c.submit(prompt="hello", max_tokens=1500, temperature=0, ignore_eos=True)
        wait_for(lambda: running() == 1, 30, "the worker's record to show the job in its batch")
        c.cancel(job.id)
        assert job.result(timeout=60).status == "cancelled"
    wait_for(lambda: running() == 0, 30, "the worker's record to show its batch empty")
    assert status_json(redis_url, queue)["pending"] == 0
