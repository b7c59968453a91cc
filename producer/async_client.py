"""The asyncio client: Client's API with await and async for, over redis.asyncio."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ResponseError

from producer import ops
from producer.keys import Keys
from producer.protocol import JobRequest, JobResult, Limits, StreamEvent
from producer.scripts import Scripts


class AsyncClient:
    """`AsyncClient(url, queue="default")`. url None: $REDIS_URL, else redis://localhost:6379/0."""

    def __init__(self, url: str | None = None, queue: str = "default", *, redis: aredis.Redis | None = None,
                 limits: Limits | None = None, result_ttl: int = ops.DEFAULT_TTL) -> None:
        self.redis = redis or aredis.Redis.from_url(ops.redis_url(url), decode_responses=True)
        self.keys = Keys(queue)
        self.limits = limits or Limits()
        self.result_ttl = result_ttl
        self.scripts = Scripts(self.redis)
        self.block_chunk_ms = ops.block_chunk_ms(self.redis)

    async def submit(self, request: JobRequest | dict | None = None, /, **fields: Any) -> AsyncJob:
        req = ops.make_request(request, fields, self.limits)
        keys, args = ops.submit_call(self.keys, req)
        try:
            await self.scripts.submit(keys, args)
        except ResponseError as e:
            if ops.is_duplicate(e):
                raise ops.duplicate_error([req.id], []) from None
            raise
        return AsyncJob(self, req.id)

    async def submit_many(self, requests: Iterable[JobRequest | dict]) -> list[AsyncJob]:
        reqs = [ops.make_request(r, {}, self.limits) for r in requests]
        pipe = self.redis.pipeline(transaction=False)
        for req in reqs:
            keys, args = ops.submit_call(self.keys, req)
            await self.scripts.submit(keys, args, client=pipe)
        replies = await pipe.execute(raise_on_error=False)
        return ops.submitted(reqs, replies, lambda job_id: AsyncJob(self, job_id))

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, job_id)

    async def status(self, job_id: str) -> str:
        state = await self.redis.hget(self.keys.job(job_id), "state")
        if state:
            return state
        raw = await self.redis.get(self.keys.result(job_id))
        if raw:
            return JobResult.model_validate_json(raw).status
        raise ops.not_found(job_id)

    async def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        r, k = self.redis, self.keys
        raw = await r.get(k.result(job_id))
        if raw:
            return JobResult.model_validate_json(raw)
        last = "0-0"
        tail = await r.xrevrange(k.events(job_id), count=1)
        if tail:
            ev = ops.parse_event(*tail[0])
            if ev.terminal:
                return ev.result
            last = ev.event_id
        elif not await r.exists(k.job(job_id)):
            raise ops.not_found(job_id)
        deadline = ops.Deadline(timeout, self.block_chunk_ms)
        while True:
            reply = await r.xread({k.events(job_id): last}, count=1000, block=deadline.block_ms())
            for ev in ops.parse_events(reply):
                last = ev.event_id
                if ev.terminal:
                    return ev.result
            if deadline.expired():
                raise TimeoutError(f"job {job_id} has no result after {timeout} s")

    async def stream(self, job_id: str, timeout: float | None = None,
                     after: str = "0-0") -> AsyncIterator[StreamEvent]:
        r, k = self.redis, self.keys
        if after == "0-0" and not await r.exists(k.events(job_id)):
            raw = await r.get(k.result(job_id))
            if raw:
                yield ops.result_event(raw)
                return
            if not await r.exists(k.job(job_id)):
                raise ops.not_found(job_id)
        deadline = ops.Deadline(timeout, self.block_chunk_ms)
        last = after
        while True:
            reply = await r.xread({k.events(job_id): last}, count=1000, block=deadline.block_ms())
            for ev in ops.parse_events(reply):
                last = ev.event_id
                yield ev
                if ev.terminal:
                    return
            if deadline.expired():
                raise TimeoutError(f"job {job_id} did not finish within {timeout} s")

    async def cancel(self, job_id: str) -> str:
        keys, args = ops.cancel_call(self.keys, job_id, self.result_ttl)
        try:
            return await self.scripts.cancel(keys, args)
        except ResponseError as e:
            if str(e).startswith("NOT_FOUND"):
                raise ops.not_found(job_id) from None
            raise

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncJob:
    def __init__(self, client: AsyncClient, job_id: str) -> None:
        self.client = client
        self.id = job_id

    async def status(self) -> str:
        return await self.client.status(self.id)

    async def result(self, timeout: float | None = None) -> JobResult:
        return await self.client.result(self.id, timeout)

    def stream(self, timeout: float | None = None, after: str = "0-0") -> AsyncIterator[StreamEvent]:
        return self.client.stream(self.id, timeout, after)

    async def cancel(self) -> str:
        return await self.client.cancel(self.id)

    def __repr__(self) -> str:
        return f"AsyncJob({self.id!r})"
