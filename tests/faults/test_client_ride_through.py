"""The Python clients ride through a Redis restart (AOF on, same port): submits keep succeeding without duplicates,
result() and stream() keep waiting and resume where they were, and past the grace the error says what happened."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
from faults import wait_for

from producer import AsyncClient, Client, DuplicateJobError, RedisUnavailable, calls, flows, wire
from producer.protocol import JobResult, StreamEvent
from producer.ride import Ride
from worker.redis_server import RedisServer

WORKER_FLAGS = ("--max-num-seqs", "8", "--num-kv-blocks", "256", "--max-model-len", "256")
LONG = {"prompt": "ride", "max_tokens": 120, "ignore_eos": True, "temperature": 0}


def _submitting(client: Client, stop: threading.Event, ids: list, errors: list, waits: list) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                ids.append(client.submit(prompt="hi", max_tokens=4).id)
            except Exception as e:  # noqa: BLE001 - the test counts every failure
                errors.append(e)
            waits.append(time.monotonic() - t0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _jobs_stored(srv: RedisServer, client: Client) -> tuple[int, int]:
    r = redis.Redis.from_url(srv.url, decode_responses=True)
    try:
        return r.xlen(client.keys.stream("default")), len(list(r.scan_iter(client.keys.job("*"), count=1000)))
    finally:
        r.close()


def test_submits_ride_through_a_restart(queue):
    with RedisServer(aof=True) as srv:
        c = Client(srv.url, queue=queue)
        ids, errors, waits, stop = [], [], [], threading.Event()
        t = _submitting(c, stop, ids, errors, waits)
        while len(ids) < 20:
            time.sleep(0.01)
        srv.restart(down_s=2.0)
        after = len(ids)
        while len(ids) < after + 20:
            time.sleep(0.01)
        stop.set()
        t.join(60)
        assert not errors, errors[:3]
        assert max(waits) >= 1.5  # one submit really waited out the outage
        assert len(set(ids)) == len(ids)
        assert _jobs_stored(srv, c) == (len(ids), len(ids))  # every acknowledged job is queued once
        c.close()


def test_async_submits_ride_through_a_restart(queue):
    async def go(srv: RedisServer) -> list[str]:
        async with AsyncClient(srv.url, queue=queue) as c:
            first = [(await c.submit(prompt="a", max_tokens=4)).id for _ in range(5)]
            restart = asyncio.create_task(asyncio.to_thread(srv.restart, 2.0))
            await asyncio.sleep(0.2)  # the server is going down now
            during = [(await c.submit(prompt="b", max_tokens=4)).id for _ in range(5)]
            await restart
            assert await c.status(during[0]) == "queued"
            return first + during

    with RedisServer(aof=True) as srv:
        ids = asyncio.run(go(srv))
        assert len(set(ids)) == 10
        assert _jobs_stored(srv, Client(srv.url, queue=queue)) == (10, 10)


def test_a_retried_submit_that_finds_its_own_job_succeeds(redis_url, queue):
    c = Client(redis_url, queue=queue)
    call = calls.submit(c.keys, flows.make_request(None, {"prompt": "x", "max_tokens": 4}))
    flows.drive(c.redis, flows.run_call(call))  # the first try landed; its reply was lost
    ride = Ride(5.0, "test")
    # The very call sent again with no retry of the ride's: redis-py's own Retry re-sends a command on a dropped
    # connection, unseen by the ride. Its own enqueued_at tells it is this call's job.
    assert flows.drive(c.redis, flows.submit(call, None, ride), ride) == call.job_id
    again = calls.submit(c.keys, flows.make_request(None, {"id": call.job_id, "prompt": "x", "max_tokens": 4}))
    with pytest.raises(DuplicateJobError):  # another submit of the same job, no retry: a plain duplicate
        flows.drive(c.redis, flows.submit(again, None, ride), ride)
    ride.retried = True
    assert flows.drive(c.redis, flows.submit(call, None, ride), ride) == call.job_id
    other = calls.submit(c.keys, flows.make_request(None, {"id": call.job_id, "prompt": "other", "max_tokens": 4}))
    with pytest.raises(DuplicateJobError):  # the same id with another payload is someone else's job
        flows.drive(c.redis, flows.submit(other, None, ride), ride)
    assert c.redis.xlen(c.keys.stream("default")) == 1
    # submit_many: a batch re-sent after a lost reply finds its own jobs, and submits the rest
    new = calls.submit(c.keys, flows.make_request(None, {"prompt": "y", "max_tokens": 4}))
    assert flows.drive(c.redis, flows.submit_many([call, new], None, ride), ride) == [call.job_id, new.job_id]
    with pytest.raises(DuplicateJobError) as dup:
        flows.drive(c.redis, flows.submit_many([other], None, ride), ride)
    assert dup.value.ids == [call.job_id]
    assert c.redis.xlen(c.keys.stream("default")) == 2
    c.close()


def test_past_the_grace_the_error_names_redis(queue):
    srv = RedisServer(password="s3cret").start()
    c = Client(srv.url, queue=queue, grace=1.0)
    c.submit(prompt="x", max_tokens=4)
    srv.stop()
    t0 = time.monotonic()
    with pytest.raises(RedisUnavailable) as err:
        c.submit(prompt="y", max_tokens=4)
    assert 1.0 <= time.monotonic() - t0 < 10
    msg = str(err.value)
    assert "Redis at redis://:***@127.0.0.1:" in msg and "unreachable for " in msg and "s3cret" not in msg
    assert isinstance(err.value, redis.ConnectionError)  # what callers caught before still catches it
    with pytest.raises(TimeoutError):  # a result() timeout shorter than the grace ends the wait first
        Client(redis=c.redis, queue=queue, grace=30).result("nope", timeout=0.5)
    with pytest.raises(redis.ConnectionError):  # grace 0: no retries
        Client(redis=c.redis, queue=queue, grace=0).status("nope")
    with pytest.raises(ValueError, match="grace"):
        Client(redis=c.redis, queue=queue, grace=-1)


def test_a_wrong_password_is_no_outage(queue):
    with RedisServer(password="right") as srv:
        c = Client(redis=redis.Redis(port=srv.port, password="wrong", decode_responses=True), queue=queue)
        t0 = time.monotonic()
        with pytest.raises(redis.AuthenticationError):
            c.status("x")
        assert time.monotonic() - t0 < c.grace / 2  # refused at once, not after the grace


def test_what_counts_as_an_outage():
    from producer.ride import is_outage

    assert is_outage(redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."))
    assert is_outage(redis.BusyLoadingError("Redis is loading the dataset in memory"))
    assert is_outage(redis.ReadOnlyError("You can't write against a read only replica."))
    assert is_outage(redis.TimeoutError("Timeout reading from socket"))
    assert not is_outage(redis.AuthenticationError("invalid username-password pair"))
    assert not is_outage(redis.ConnectionError("Error 1 connecting to h:6380. [SSL: CERTIFICATE_VERIFY_FAILED] "
                                               "certificate verify failed: unable to get local issuer certificate"))
    assert not is_outage(redis.ResponseError("WRONGTYPE"))
    assert not is_outage(redis.exceptions.MaxConnectionsError("Too many connections"))
    busy = redis.ConnectionError("No connection available.")
    busy.__cause__ = TimeoutError()
    assert not is_outage(busy)  # a full blocking pool: the caller's back-pressure, not Redis away


@pytest.mark.slow
def test_submits_ride_through_a_sentinel_failover(queue):
    from redis_sentinel import SentinelSet

    with SentinelSet() as s:
        # Under load a Sentinel can sit in TILT for 30 s before it fails over: this test's grace allows for it.
        c = Client(s.url, queue=queue, grace=120)
        ids, errors, waits, stop = [], [], [], threading.Event()
        t = _submitting(c, stop, ids, errors, waits)
        while len(ids) < 20:
            time.sleep(0.01)
        old = s.kill_primary()
        acked_at_kill = len(ids)
        new = s.wait_promoted(old)
        after = len(ids)
        while len(ids) < after + 20:
            time.sleep(0.01)
        stop.set()
        t.join(150)
        assert not errors, errors[:3]
        assert len(set(ids)) == len(ids)
        r = redis.Redis(port=new.port, decode_responses=True)
        queued = [f["id"] for _, f in r.xrange(c.keys.stream("default"))]
        r.close()
        assert len(set(queued)) == len(queued)  # no job queued twice by a retried submit
        # Asynchronous replication: what the primary had not sent before SIGKILL is gone; every submit
        # acknowledged once the replica took over is there.
        lost = set(ids) - set(queued)
        assert not lost & set(ids[acked_at_kill + 1:]), sorted(lost)
        print(f"failover: {len(ids)} submits acknowledged, 0 failed, {len(lost)} lost with the old primary, "
              f"longest submit {max(waits):.1f} s")
        c.close()


def test_result_and_stream_ride_through_a_restart(queue, pq_tiny_model, start_worker):
    with RedisServer(aof=True) as srv:
        start_worker(queue, pq_tiny_model, *WORKER_FLAGS, "--lease-ms", "3000", url=srv.url,
                     hooks={"step-delay-ms": 30})
        c = Client(srv.url, queue=queue)
        jobs = c.submit_many([{**LONG, "id": f"{queue}-{i}"} for i in range(3)])
        out: dict = {}

        async def astream(job_id: str) -> list:
            async with AsyncClient(srv.url, queue=queue) as ac:
                return [ev async for ev in ac.stream(job_id, timeout=180)]

        threads = [threading.Thread(target=lambda: out.__setitem__("result", c.result(jobs[0].id, timeout=180))),
                   threading.Thread(target=lambda: out.__setitem__("stream", list(c.stream(jobs[1].id, 180)))),
                   threading.Thread(target=lambda: out.__setitem__("astream", asyncio.run(astream(jobs[2].id))))]
        for t in threads:
            t.start()
        probe = redis.Redis.from_url(srv.url, decode_responses=True)
        end = time.monotonic() + 120
        while probe.xlen(c.keys.events(jobs[1].id)) < 3:
            assert time.monotonic() < end
            time.sleep(0.05)
        assert not probe.exists(c.keys.result(jobs[1].id))  # the restart comes mid-stream
        probe.close()
        srv.restart(down_s=2.0)
        for t in threads:
            t.join(200)
        assert out["result"].status == "completed"
        for name, job in (("stream", jobs[1]), ("astream", jobs[2])):
            evs = out[name]
            assert [e.terminal for e in evs].count(True) == 1 and evs[-1].terminal, name
            ids = [e.event_id for e in evs]
            assert len(set(ids)) == len(ids), name
            res = c.result(job.id, timeout=10)
            assert res.status == "completed"
            # every token once, in order: what the stream yielded is the job's output
            assert [t for e in evs[:-1] for t in e.token_ids] == res.token_ids, name
        c.close()


def test_results_ride_through_a_sentinel_failover(queue, pq_tiny_model, start_worker):
    from redis_sentinel import SentinelSet

    with SentinelSet() as s:
        w = start_worker(queue, pq_tiny_model, *WORKER_FLAGS, "--lease-ms", "2000", url=s.url,
                         hooks={"step-delay-ms": 30})
        try:
            # replicated: every acknowledged job is on the replica before the primary dies
            c = Client(s.url, queue=queue, durability="replicated", grace=120)
            jobs = c.submit_many([{**LONG, "id": f"{queue}-f{i}"} for i in range(4)])
            out: dict = {}
            threads = [threading.Thread(target=lambda j=j: out.__setitem__(j.id, c.result(j.id, timeout=240)))
                       for j in jobs]
            for t in threads:
                t.start()
            end = time.monotonic() + 120
            while c.redis.xlen(c.keys.events(jobs[0].id)) < 3:
                assert time.monotonic() < end
                time.sleep(0.05)
            assert not c.redis.exists(c.keys.result(jobs[0].id))  # the failover comes mid-job
            s.wait_promoted(s.kill_primary())
            for t in threads:
                t.join(260)
            assert sorted(out) == sorted(j.id for j in jobs)  # every waiting result() returned
            assert all(r.status == "completed" for r in out.values()), [(r.id, r.error) for r in out.values()]
            c.close()
        finally:
            w.stop(30)


def test_a_followed_stream_skips_chunks_written_again_after_a_failover(redis_url, queue):
    """What a reader meets across an async failover that lost a job's last chunks, written by hand: the chunks it had
    read on the old primary come again under new entry ids (the worker heals the stream); it yields each token once."""
    c = Client(redis_url, queue=queue)
    events = c.keys.events("j")

    def chunk(offset: int, *ids: int) -> None:
        c.redis.xadd(events, {"e": wire.token_event("".join(map(str, ids)), list(ids)), "o": offset})

    chunk(0, 0, 1)
    chunk(2, 2, 3)
    got: list = []
    reading = threading.Thread(target=lambda: [got.append(e) for e in c.stream("j", timeout=60)], daemon=True)
    reading.start()
    wait_for(lambda: len(got) == 2, 10, "the reader has both chunks")
    chunk(2, 2, 3)  # again, as after the failover
    chunk(4, 4)
    done = JobResult(id="j", status="completed", token_ids=[0, 1, 2, 3, 4])
    c.redis.xadd(events, {"e": StreamEvent(type="done", result=done).model_dump_json()})
    reading.join(30)
    assert [t for e in got[:-1] for t in e.token_ids] == [0, 1, 2, 3, 4] and got[-1].type == "done"
    c.close()
