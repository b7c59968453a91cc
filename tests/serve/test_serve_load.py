"""`pagedq serve` under load (issue 30): a thousand concurrent requests through one server process on a handful of
Redis connections, every one answered whole or refused with 429 and Retry-After; and Redis stopped under load:
503 naming Redis, then new requests succeed once it is back, and nothing hangs.

Real processes: redis-server, a worker on a tiny random-weight model, `pagedq serve` on a free port; the requests
come from one asyncio httpx client in the test."""

import asyncio
import json
import threading
import time

import httpx
import pytest
import redis
from faults import wait_for

from producer.keys import Keys
from producer.protocol import JobResult
from serve.events import READER_NAME
from serve.queues import CLIENT_NAME
from worker.redis_server import stop_process

pytestmark = pytest.mark.slow

REQUESTS = 1000
MAX_OPEN = 700  # below REQUESTS: the rest must be refused with 429 and Retry-After, not fail
CONNECTIONS = 16  # --redis-connections
TOKENS = 8


class ConnectionWatch(threading.Thread):
    """The most connections the serve process and the whole Redis held at once, sampled while the load runs."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.stop = threading.Event()
        self.serve = self.total = 0

    def run(self) -> None:
        while not self.stop.wait(0.1):
            clients = self.r.client_list()
            self.total = max(self.total, len(clients))
            self.serve = max(self.serve, sum(c.get("name") in (CLIENT_NAME, READER_NAME) for c in clients))

    def __enter__(self) -> "ConnectionWatch":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join()
        self.r.close()


async def _one(http: httpx.AsyncClient, i: int, stream: bool) -> tuple[int, str | None, str, dict]:
    """(status, the answer's text or None, its job id or "", the refusal's headers and error)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = await http.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return r.status_code, None, "", {"retry-after": r.headers.get("retry-after"), **r.json()["error"]}
        out = r.json()
        assert out["usage"]["completion_tokens"] == TOKENS, out
        return 200, out["choices"][0]["message"]["content"], out["id"].split("-", 1)[1], {}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None, "", {"retry-after": r.headers.get("retry-after"), **r.json()["error"]}
        parts, finish, job, events = [], None, "", []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
        assert events[-1] == "[DONE]", events[-3:]
        for e in events[:-1]:
            chunk = json.loads(e)
            assert "error" not in chunk, chunk
            job = chunk["id"].split("-", 1)[1]
            for choice in chunk["choices"]:
                parts.append(choice["delta"].get("content") or "")
                finish = choice["finish_reason"] or finish
        assert finish == "length", events[-3:]
        return 200, "".join(parts), job, {}


async def _load(base: str, n: int) -> list[tuple[int, str | None, str, dict]]:
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=httpx.Timeout(180, pool=180)) as http:
        return await asyncio.gather(*(_one(http, i, i % 2 == 1) for i in range(n)))


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_thousand_concurrent_requests(redis_url, queue, pq_tiny_model, start_worker, start_serve, rds):
    start_worker(queue, pq_tiny_model, "--max-num-seqs", "256", "--num-kv-blocks", "1024", "--max-model-len", "128",
                 "--served-model-name", "tiny")
    base = start_serve(queue, "--model", "tiny", "--max-open-requests", str(MAX_OPEN),
                       "--redis-connections", str(CONNECTIONS), "--retry-after", "2")
    # The worker has loaded its model and run its first steps before the load starts.
    httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
               timeout=120).raise_for_status()
    start = time.monotonic()
    with ConnectionWatch(redis_url) as watch:
        outcomes = asyncio.run(_load(base, REQUESTS))
    took = time.monotonic() - start

    ok = [(text, job) for status, text, job, _ in outcomes if status == 200]
    refused = [err for status, _, _, err in outcomes if status != 200]
    assert all(status in (200, 429) for status, *_ in outcomes), [o for o in outcomes if o[0] not in (200, 429)][:3]
    assert all(err["retry-after"] == "2" and err["code"] == "open_requests" for err in refused), refused[:3]
    # No request is refused while fewer than MAX_OPEN are open: at least that many got in.
    assert len(ok) >= MAX_OPEN, (len(ok), len(refused))
    # Each answer is its job's whole text, as the worker stored it.
    keys = Keys(queue)
    stored = rds.mget([keys.result(job) for _, job in ok])
    for (text, job), raw in zip(ok, stored, strict=True):
        assert raw is not None, job
        res = JobResult.model_validate_json(raw)
        assert res.status == "completed" and res.text == text and len(res.token_ids) == TOKENS, (job, res.status)
    # A handful of Redis connections for a thousand requests: the pool's, plus the reader's two.
    assert 1 <= watch.serve <= CONNECTIONS + 2, watch.serve
    print(f"{REQUESTS} requests in {took:.1f} s: {len(ok)} answered, {len(refused)} refused (429); serve held at "
          f"most {watch.serve} Redis connections, Redis {watch.total} in all")
    assert _metric(base, "pagedq_serve_open_requests") == 0
    assert _metric(base, 'pagedq_serve_refused_total{reason="open_requests"}') == len(refused)
    assert _metric(base, 'pagedq_serve_reader_waiters{reader="redis"}') == 0


def test_redis_stopped_under_load(queue, pq_tiny_model, start_worker, start_serve):
    from worker.redis_server import RedisServer

    with RedisServer(aof=True) as srv:
        worker = start_worker(queue, pq_tiny_model, "--max-num-seqs", "64", "--num-kv-blocks", "4096",
                              "--max-model-len", "1024", "--served-model-name", "tiny", url=srv.url)
        base = start_serve(queue, "--model", "tiny", "--redis-grace", "1", url=srv.url)
        httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                   timeout=120).raise_for_status()

        async def long_one(http: httpx.AsyncClient, i: int, stream: bool, started: asyncio.Event) -> tuple:
            body = {"model": "tiny", "prompt": f"long {i}", "max_tokens": 900, "ignore_eos": True, "stream": stream}
            if not stream:
                r = await http.post("/v1/completions", json=body)
                return r.status_code, r.json()
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, r.json()
                last = None
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        started.set()
                        last = json.loads(line[len("data: "):])
                return 200, last

        async def load() -> list[tuple]:
            started = asyncio.Event()
            async with httpx.AsyncClient(base_url=base, timeout=120,
                                         limits=httpx.Limits(max_connections=200)) as http:
                tasks = [asyncio.ensure_future(long_one(http, i, i % 2 == 0, started)) for i in range(60)]
                await asyncio.wait_for(started.wait(), 120)
                # Redis goes away for longer than --redis-grace: every waiting request ends, naming Redis.
                stopper = asyncio.ensure_future(asyncio.to_thread(srv.restart, 4.0))
                outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 60)  # nothing hangs
                await stopper
                return outcomes

        outcomes = asyncio.run(load())
        for status, body in outcomes:
            if status == 200 and "error" not in (body or {}):
                continue  # finished before Redis went away
            err = body["error"]
            assert status in (200, 503) and err["code"] == "redis_unavailable", (status, body)
            assert "Redis" in err["message"], err
        cut = sum(status == 200 and "error" in (body or {}) for status, body in outcomes)
        refused = sum(status == 503 for status, _ in outcomes)
        assert cut + refused >= 1, outcomes[:3]
        print(f"Redis stopped under {len(outcomes)} requests: {refused} answered 503, {cut} streams ended with "
              f"the error, {len(outcomes) - cut - refused} finished before")

        # Redis is back: new requests succeed, streamed and not, and no request is left open.
        oa = httpx.Client(base_url=base, timeout=120)
        wait_for(lambda: oa.get("/health").status_code == 200, 30, "/health to answer again")
        r = oa.post("/v1/completions", json={"model": "tiny", "prompt": "again", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        with oa.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "again", "max_tokens": 4,
                                                         "ignore_eos": True, "stream": True}) as s:
            assert s.status_code == 200 and list(s.iter_lines())[-2] == "data: [DONE]"
        wait_for(lambda: _metric(base, "pagedq_serve_open_requests") == 0, 30, "no request left open")
        assert _metric(base, 'pagedq_serve_refused_total{reason="redis_unavailable"}') >= 1
        oa.close()
        stop_process(worker, 30)  # before its Redis goes for good



def test_readers_per_slot_on_a_cluster(redis_cluster, cluster_queues, pq_tiny_model, start_worker, start_serve):
    """Two queues on two masters, one serve process pointed at any node: a reader per queue's slot, each on the
    node that serves it (a command's keys must share a slot), and every answer whole."""
    qa, qb = cluster_queues
    url = redis_cluster.urls[0]
    flags = ("--max-num-seqs", "32", "--num-kv-blocks", "512", "--max-model-len", "128")
    start_worker(qa, pq_tiny_model, *flags, "--served-model-name", "a", url=url)
    start_worker(qb, pq_tiny_model, *flags, "--served-model-name", "b", url=url)
    base = start_serve(qa, "--route", f"a={qa}", "--route", f"b={qb}", url=url)

    async def one(http: httpx.AsyncClient, model: str, i: int, stream: bool) -> tuple[str, str]:
        body = {"model": model, "prompt": f"{model} {i}", "max_tokens": 6, "ignore_eos": True, "temperature": 0,
                "stream": stream}
        if not stream:
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["id"].split("-", 1)[1], r.json()["choices"][0]["text"]
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            chunks = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
        return chunks[0]["id"].split("-", 1)[1], "".join(c["choices"][0]["text"] for c in chunks if c["choices"])

    async def load() -> list[tuple[str, str, str]]:
        async with httpx.AsyncClient(base_url=base, timeout=180) as http:
            work = [(m, i, i % 2 == 0) for m in ("a", "b") for i in range(40)]
            outs = await asyncio.gather(*(one(http, m, i, s) for m, i, s in work))
        return [(m, job, text) for (m, _, _), (job, text) in zip(work, outs, strict=True)]

    from producer import Client

    answers = asyncio.run(load())
    clients = {"a": Client(url, queue=qa), "b": Client(url, queue=qb)}
    for model, job, text in answers:
        res = clients[model].result(job, timeout=60)
        assert res.status == "completed" and res.text == text and len(res.token_ids) == 6, (model, job)
    metrics = httpx.get(f"{base}/metrics").text
    readers = {line.split('reader="')[1].split('"')[0] for line in metrics.splitlines()
               if line.startswith("pagedq_serve_reader_waiters{")}
    slots = {clients[m].redis.keyslot(clients[m].keys.jobs) for m in ("a", "b")}
    assert readers == {f"slot {s}" for s in slots}, (readers, slots)
    for c in clients.values():
        c.close()


def test_serve_load_bench_smoke(tmp_path):
    """`pagedq bench -w serve-load` on a few streams: both paths complete everything and the JSON has each figure
    (the measurement itself is the benchmark's, not the suite's)."""
    from bench.serve_load import run_serve_load

    data = run_serve_load("cpu", quick=True, streams=6, out_dir=str(tmp_path), echo=lambda s: None)
    assert data["direct"]["completed"] == data["serve"]["completed"] == 6, data
    assert data["success_rate"] == 1.0
    assert 1 <= data["serve"]["redis_connections_max"] <= 18
    assert all(data["serve"][k] > 0 for k in ("ttft_p99_s", "e2e_p99_s", "serve_cpu_s_per_1k_tokens"))
    assert json.loads((tmp_path / "serve-load.json").read_text())["workload"] == "serve-load"


def test_concurrent_submits_share_round_trips(redis_url, queue, monkeypatch):
    """serve.submits: 300 requests submitting at once go out in a few pipelines, each job created once; a duplicate
    id fails that request alone; a request that left before its batch went out queues no job; and a Redis that is
    gone fails every request of the round trip with its error."""
    import redis.asyncio as aredis

    from producer import AsyncClient, DuplicateJobError, JobNotFound, JobRequest
    from serve import submits

    trips = []
    real = submits.flows.adrive

    async def counted(r, flow):
        trips.append(1)
        return await real(r, flow)

    monkeypatch.setattr(submits.flows, "adrive", counted)

    def request(i):
        return JobRequest(id=f"j{i}", model="m", prompt="hi", max_tokens=2)

    async def scenario():
        async with AsyncClient(redis_url, queue=queue) as client:
            batcher = submits.Submits(client)
            await batcher.submit(request("dup"))
            assert len(trips) == 1  # a lone request: one round trip
            outs = await asyncio.gather(*(batcher.submit(request(i)) for i in range(300)),
                                        batcher.submit(request("dup")), return_exceptions=True)
            assert outs[:300] == [None] * 300 and isinstance(outs[300], DuplicateJobError)
            assert 2 <= len(trips) <= 4  # 301 scripts in pipelines of at most 256: 2 round trips after the first
            assert [await client.status(f"j{i}") for i in (0, 299)] == ["queued", "queued"]
            left = asyncio.ensure_future(batcher.submit(request("left")))
            stays = asyncio.ensure_future(batcher.submit(request("stays")))
            await asyncio.sleep(0)
            left.cancel()
            await stays
            with pytest.raises(JobNotFound):
                await client.status("left")
            await batcher.close()
        gone = AsyncClient(redis=aredis.Redis(port=1, socket_connect_timeout=1), queue=queue)
        batcher = submits.Submits(gone)
        outs = await asyncio.gather(*(batcher.submit(request(f"g{i}")) for i in range(3)), return_exceptions=True)
        assert all(isinstance(o, redis.exceptions.ConnectionError) for o in outs)

    asyncio.run(scenario())
