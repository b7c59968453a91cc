"""Client and AsyncClient against a real redis-server, with the worker's side played by the real Lua scripts."""

import asyncio
import contextlib
import threading
import time

import pytest
import redis

from producer import AsyncClient, Client, DuplicateJobError, JobNotFound, JobRequest, JobResult, calls, flows
from producer.errors import LeaseLost
from producer.keys import GROUP

SETTINGS = calls.WorkerSettings("w1", lease_ms=60000, max_attempts=3, ttl=60, dlq_cap=100)


class ScriptWorker:
    """The worker's Redis side in miniature: takes jobs and writes tokens and results with the scripts."""

    def __init__(self, rds: redis.Redis, client: Client) -> None:
        self.r, self.k = rds, client.keys
        with contextlib.suppress(redis.ResponseError):
            rds.xgroup_create(self.k.jobs, GROUP, id="0", mkstream=True)

    def run(self, call: calls.Call):
        return flows.drive(self.r, flows.run_call(call))

    def take(self) -> tuple[str, str, str]:
        (_, [(entry, fields)]), = self.r.xreadgroup(GROUP, "w1", {self.k.jobs: ">"}, count=1)
        jid = fields["id"]
        started = self.run(calls.start(self.k, calls.Delivery(jid, entry, "lease-1"), SETTINGS, 1.0))
        return jid, entry, started.outcome

    def tokens(self, jid: str, texts: list[str], lease: str = "lease-1") -> list[str]:
        emitted = int(self.r.hget(self.k.job(jid), "emitted") or 0)
        chunks = [calls.Chunk(jid, lease, emitted + i, 1, f'{{"type":"token","text":"{t}","token_ids":[{emitted + i}]}}')
                  for i, t in enumerate(texts)]
        return self.run(calls.publish(self.k, chunks))

    def complete(self, jid: str, entry: str, text: str, lease: str = "lease-1") -> None:
        res = JobResult(id=jid, status="completed", text=text, finish_reason="stop")
        self.run(calls.complete(self.k, calls.Delivery(jid, entry, lease), "completed", res.model_dump_json(), 60))


@pytest.fixture
def client(redis_url, queue):
    with Client(redis_url, queue=queue) as c:
        yield c


def test_submit_status_result_stream(client, rds):
    job = client.submit(prompt="hello", max_tokens=8)
    assert job.status() == "queued"
    w = ScriptWorker(rds, client)
    jid, entry, status = w.take()
    assert (jid, status) == (job.id, "ok") and job.status() == "running"

    got = []
    waiter = threading.Thread(target=lambda: got.append(job.result(timeout=10)))
    waiter.start()
    assert w.tokens(jid, ["Hel", "lo"]) == ["ok", "ok"]
    time.sleep(0.1)
    w.complete(jid, entry, "Hello")
    waiter.join(10)
    assert got and got[0].text == "Hello" and got[0].status == "completed"

    # A subscriber that comes after the end still gets the whole stream, then the result.
    events = list(job.stream(timeout=5))
    assert [e.type for e in events] == ["token", "token", "done"]
    assert "".join(e.text for e in events) == "Hello" and events[-1].result.text == "Hello"
    assert job.status() == "completed" and job.result(timeout=1).text == "Hello"
    assert rds.xpending(client.keys.jobs, GROUP)["pending"] == 0
    assert rds.xlen(client.keys.jobs) == 0  # acked entries are deleted: the stream's length is the backlog
    assert rds.ttl(client.keys.result(jid)) > 0 and rds.ttl(client.keys.events(jid)) > 0


def test_duplicate_id_makes_one_job(client, rds):
    client.submit(JobRequest(id="same", prompt="a"))
    with pytest.raises(DuplicateJobError, match="same"):
        client.submit(id="same", prompt="b")
    assert rds.xlen(client.keys.jobs) == 1
    with pytest.raises(DuplicateJobError) as e:
        client.submit_many([{"id": "x1", "prompt": "a"}, {"id": "same", "prompt": "a"}, {"id": "x2", "prompt": "a"}])
    assert e.value.ids == ["same"] and [j.id for j in e.value.jobs] == ["x1", "x2"]
    assert rds.xlen(client.keys.jobs) == 3


def test_submit_many_and_chat(client, rds):
    jobs = client.submit_many([JobRequest(prompt=f"p{i}") for i in range(20)]
                              + [{"messages": [{"role": "user", "content": "hi"}]}])
    assert len(jobs) == 21 and rds.xlen(client.keys.jobs) == 21
    assert all(j.status() == "queued" for j in jobs)


def test_client_side_validation(client, rds):
    with pytest.raises(ValueError, match="max_tokens"):
        client.submit(prompt="a", max_tokens=0)
    client.limits.max_tokens = 10
    with pytest.raises(ValueError, match="limit is 10"):
        client.submit(prompt="a", max_tokens=11)
    assert rds.xlen(client.keys.jobs) == 0


def test_cancel_queued(client, rds):
    job = client.submit(prompt="a")
    assert job.cancel() == "cancelled"
    assert job.status() == "cancelled" and job.result(timeout=1).status == "cancelled"
    assert [e.type for e in job.stream(timeout=1)] == ["cancelled"]
    assert rds.xlen(client.keys.jobs) == 0
    assert job.cancel() == "cancelled"  # again: the terminal state, unchanged


def test_cancel_running_and_lease_guard(client, rds):
    job = client.submit(prompt="a")
    w = ScriptWorker(rds, client)
    jid, entry, _ = w.take()
    assert w.tokens(jid, ["a"]) == ["ok"]
    assert job.cancel() == "cancelling"
    assert w.tokens(jid, ["b"]) == ["cancel"]  # the worker learns of the cancel from its next publish
    assert w.tokens(jid, ["c"], lease="stale") == ["lost"]
    with pytest.raises(LeaseLost):
        w.complete(jid, entry, "x", lease="stale")
    w.complete(jid, entry, "ab")
    assert w.tokens(jid, ["late"]) == ["lost"]  # finished: no more writes


def test_start_skips_cancelled_entry(client, rds):
    job = client.submit(prompt="a")
    w = ScriptWorker(rds, client)
    (_, [(entry, _)]), = rds.xreadgroup(GROUP, "w1", {client.keys.jobs: ">"}, count=1)
    job.cancel()
    started = w.run(calls.start(client.keys, calls.Delivery(job.id, entry, "l"), SETTINGS, 1.0))
    assert started == calls.Started("skip", state="cancelled")
    assert rds.xpending(client.keys.jobs, GROUP)["pending"] == 0


def test_unknown_job_and_timeout(client):
    with pytest.raises(JobNotFound):
        client.result("nope", timeout=1)
    with pytest.raises(JobNotFound):
        client.job("nope").status()
    with pytest.raises(JobNotFound):
        client.job("nope").cancel()
    job = client.submit(prompt="a")
    t = time.monotonic()
    with pytest.raises(TimeoutError):
        job.result(timeout=0.3)
    assert 0.25 < time.monotonic() - t < 3


def test_async_client(redis_url, queue, rds):
    async def main():
        async with AsyncClient(redis_url, queue=queue) as ac:
            job = await ac.submit(prompt="hi")
            jobs = await ac.submit_many([{"prompt": "a"}, {"prompt": "b"}])
            with pytest.raises(DuplicateJobError):
                await ac.submit(id=job.id, prompt="x")
            assert await job.status() == "queued" and len(jobs) == 2
            w = ScriptWorker(rds, Client(redis_url, queue=queue))
            jid, entry, _ = await asyncio.to_thread(w.take)
            assert jid == job.id
            waiter = asyncio.create_task(job.result(timeout=10))
            await asyncio.sleep(0.05)
            w.tokens(jid, ["h", "i"])
            w.complete(jid, entry, "hi")
            assert (await waiter).text == "hi"
            assert [e.text async for e in job.stream(timeout=2)][:2] == ["h", "i"]
            assert await jobs[0].cancel() == "cancelled"

    asyncio.run(main())


@pytest.mark.slow
def test_long_wait_stays_under_socket_timeout(redis_url, queue):
    # A blocking read must never outlast the connection's socket timeout: it waits in shorter slices.
    r = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=0.3)
    c = Client(queue=queue, redis=r)
    job = c.submit(prompt="a")
    t = time.monotonic()
    with pytest.raises(TimeoutError):
        job.result(timeout=1.0)
    assert time.monotonic() - t >= 0.9
    with pytest.raises(TimeoutError):
        list(job.stream(timeout=0.8))


def test_stream_after_the_end(client, rds):
    """A reader that reconnects after the terminal event (an SSE Last-Event-ID) ends at once, not at its
    timeout; one that comes after the events expired gets the stored result as the end."""
    job = client.submit(prompt="a")
    w = ScriptWorker(rds, client)
    jid, entry, _ = w.take()
    w.tokens(jid, ["x"])
    w.complete(jid, entry, "x")
    events = list(job.stream(timeout=5))
    assert [e.type for e in events] == ["token", "done"]
    assert list(job.stream(timeout=600, after=events[-1].event_id)) == []
    assert [e.type for e in job.stream(timeout=5, after=events[0].event_id)] == ["done"]
    rds.delete(client.keys.events(jid))
    late = list(job.stream(timeout=600, after=events[0].event_id))
    assert [e.type for e in late] == ["done"] and late[0].result.text == "x"
