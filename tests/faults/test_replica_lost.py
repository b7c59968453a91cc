"""Durability replicated when no replica is left to confirm (docs/guarantees.md, "When no replica confirms"): a
finished job's end is published all the same, so every acknowledged job's result() returns; the worker logs the
moment confirmations stop (once), counts it (pagedq_unreplicated_writes_total, pagedq_unreplicated) and says
`unreplicated_since` in its heartbeat until a replica confirms again, which it logs too.

Two ways to lose the replica, on a real primary, its replica and three Sentinels (tests/redis_sentinel.py): the
replica's link held (the replica unreachable, then back), and the primary SIGKILLed and never restarted (the
promoted replica alone for good)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.request

import pytest
import redis
from faults import log_of, make_requests, started, wait_for

from producer import Client
from producer.durability import Durability
from worker.redis_server import stop_process

pytestmark = pytest.mark.slow

STOPPED = "no replica confirms writes: publishing job ends anyway"
RESUMED = "replicas confirm writes again"
# One job at a time: ends held back for a replica (the old behaviour) would stop this worker's intake at once.
FLAGS = ("--max-num-seqs", "2", "--num-kv-blocks", "256", "--max-model-len", "256", "--lease-ms", "3000",
         "--durability", "replicated", "--durability-timeout-ms", "300", "--heartbeat-s", "0.5")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _records(c: Client) -> list[dict]:
    ids = c.redis.zrange(c.keys.workers, 0, -1)
    return [json.loads(r) for r in c.redis.mget([c.keys.worker(i) for i in ids]) if r] if ids else []


def _result(c: Client, job_id: str, timeout: float):
    """c.result(), waiting through the failover's connection errors (the client's own ride-through is not this
    test's subject)."""
    end = time.monotonic() + timeout
    while True:
        try:
            return c.result(job_id, timeout=max(1.0, end - time.monotonic()))
        except (redis.ConnectionError, redis.TimeoutError):
            assert time.monotonic() < end, f"job {job_id}: redis unreachable for {timeout} s"
            time.sleep(0.5)


def test_ends_are_published_while_no_replica_confirms(pq_tiny_model, start_worker, queue):
    from redis_sentinel import SentinelSet

    port = _free_port()
    with SentinelSet() as s:
        c = Client(s.url, queue=queue, durability=Durability("replicated", 1, 2000))
        w = start_worker(queue, pq_tiny_model, *FLAGS, "--metrics-port", str(port), url=s.url,
                         hooks={"step-delay-ms": 20})
        wait_for(lambda: started(w), 180, "the worker ready")
        reqs = make_requests(8, "alone", 24)
        acked = [c.submit(r).id for r in reqs]  # each confirmed by the replica: acknowledged
        s.link.hold()
        try:
            results = [c.result(i, timeout=120) for i in acked]
            assert [r.status for r in results] == ["completed"] * len(acked)
            assert all(len(r.token_ids) == 24 for r in results)
            assert _metric(port, "pagedq_unreplicated_writes_total") >= 1
            assert _metric(port, "pagedq_unreplicated") == 1
            rec = wait_for(lambda: [r for r in _records(c) if r.get("unreplicated_since")], 30,
                           "the heartbeat saying unreplicated")
            assert rec[0]["unreplicated_since"] <= time.time()
            assert log_of(w).count(STOPPED) == 1, log_of(w)
            assert RESUMED not in log_of(w)
        finally:
            s.link.release()
        wait_for(lambda: RESUMED in log_of(w), 60, "the worker saying replicas confirm again")
        wait_for(lambda: all(r.get("unreplicated_since") is None for r in _records(c)) and _records(c), 60,
                 "the heartbeat back to replicated")
        assert _metric(port, "pagedq_unreplicated") == 0
        assert log_of(w).count(STOPPED) == 1
        # Replicated again: a new job is confirmed and its end too, with nothing more said.
        assert c.submit(prompt="after", max_tokens=4).result(timeout=60).status == "completed"
        assert log_of(w).count(STOPPED) == 1
        stop_process(w, 30)
        assert "no replica confirmed; stopping anyway" not in log_of(w)
        c.close()


def test_the_primary_never_comes_back(pq_tiny_model, start_worker, queue):
    """The primary SIGKILLed with jobs acknowledged and running, its replica promoted, the old primary never
    restarted: the new primary has no replica. Every acknowledged job's result comes back, and the workers say
    they are unreplicated."""
    from redis_sentinel import SentinelSet

    with SentinelSet() as s, contextlib.ExitStack() as stack:
        c = Client(s.url, queue=queue, durability=Durability("replicated", 1, 2000))
        ws = [start_worker(queue, pq_tiny_model, *FLAGS, url=s.url, hooks={"step-delay-ms": 20}) for _ in range(2)]
        stack.callback(lambda: [stop_process(w, 30) for w in ws])
        wait_for(lambda: all(started(w) for w in ws), 180, "the workers ready")
        reqs = make_requests(12, "gone", 32)
        acked = [c.submit(r).id for r in reqs]
        wait_for(lambda: c.redis.xlen(c.keys.events(acked[0])) >= 1, 120, "the first job streaming")
        old = s.kill_primary()
        t_kill = time.monotonic()
        s.wait_promoted(old)
        t_promoted = time.monotonic()
        results = [_result(c, i, 180) for i in acked]
        assert [r.status for r in results] == ["completed"] * len(acked)
        print("replica lost row:", json.dumps({
            "acknowledged": len(acked), "completed": sum(r.status == "completed" for r in results),
            "failover_s": round(t_promoted - t_kill, 1), "last_result_s": round(time.monotonic() - t_kill, 1)}))
        wait_for(lambda: any(r.get("unreplicated_since") for r in _records(c)), 30,
                 "a heartbeat saying unreplicated")
        assert sum(log_of(w).count(STOPPED) for w in ws) >= 1
        assert all(log_of(w).count(STOPPED) <= 1 for w in ws)
        for w in ws:  # stopping alone: a short last chance for a replica, then the ends it published are let go
            stop_process(w, 30)
            assert w.returncode == 0, log_of(w)[-3000:]
            assert (STOPPED in log_of(w)) == ("stopping anyway (the primary has them)" in log_of(w))
        c.close()


def test_alone_says_it_once_reminds_and_says_when_it_resumes(caplog):
    from worker.publisher.healing import REMIND_S, Alone

    now = [100.0]
    a = Alone(clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="pagedq.worker"):
        a.note(True, 3, 0)
        assert not caplog.records  # replicated all along: nothing said
        for _ in range(5):
            a.note(False, 2, 4)
            now[0] += 1
        assert [r.getMessage().count(STOPPED) for r in caplog.records] == [1] and a.since == 100.0
        now[0] += REMIND_S
        a.note(False, 1, 5)
        assert "still no replica confirms writes after 65 s: 11 job ends published unreplicated, 5 written" in \
            caplog.records[-1].getMessage()
        a.note(True, 0, 0)
        assert RESUMED in caplog.records[-1].getMessage() and "11 job ends" in caplog.records[-1].getMessage()
        assert len(caplog.records) == 3 and a.since is None and a.ends == 0


def test_the_metrics_window(monkeypatch):
    from worker import metrics as m

    now = [1000.0]
    monkeypatch.setattr(m.time, "time", lambda: now[0])
    x = m.Metrics("q")
    assert x.unreplicated_since() is None
    x.not_replicated()
    now[0] += 5
    x.not_replicated()
    assert x.unreplicated_since() == 1000.0
    now[0] += m.ALONE_GAP_S + 1
    assert x.unreplicated_since() is None  # nothing unconfirmed for a while: replicated again
    x.not_replicated()
    assert x.unreplicated_since() == now[0]  # a new spell
