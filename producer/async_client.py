"""The asyncio client: Client's API with await and async for. A thin shell over producer.flows."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import redis.asyncio as aredis

from producer import calls, defaults, flows
from producer.client import block_chunk_ms, durability_for
from producer.connection import connect_async, redact, resolve_url
from producer.durability import Durability

# By name: a test that counts the round trips of serve's own flows.adrive (monkeypatched) leaves these alone.
from producer.flows import adrive, adrive_iter
from producer.keys import Keys
from producer.protocol import JobRequest, JobResult, Limits, StreamEvent
from producer.ride import Ride, address_of, checked_grace, deadline_of


class AsyncClient:
    """`AsyncClient(url, queue="default")`, as Client: url None is $REDIS_URL, else redis://localhost:6379/0; a
    Redis Cluster is found out from any node's URL, a redis+sentinel:// URL finds the primary through Sentinel;
    durability "replicated" (None: $PAGEDQ_DURABILITY, else "async") acknowledges a submit once a replica has it;
    grace: as Client's, how long a call rides through a Redis outage."""

    def __init__(self, url: str | None = None, queue: str = defaults.QUEUE, *, redis: aredis.Redis | None = None,
                 limits: Limits | None = None, result_ttl: int = defaults.RESULT_TTL_S,
                 durability: Durability | str | None = None, grace: float = defaults.RIDE_GRACE_S) -> None:
        self.redis = redis if redis is not None else connect_async(url, decode_responses=True)
        self.keys = Keys(queue)
        self.limits = limits or Limits()
        self.result_ttl = result_ttl
        self.block_chunk_ms = block_chunk_ms(self.redis)
        self.durability = durability_for(self.redis, durability)
        self.grace = checked_grace(grace)
        self.where = redact(resolve_url(url)) if redis is None else address_of(self.redis)

    def _ride(self, timeout: float | None = None) -> Ride:
        """A fresh retry state for one call; `timeout`: the call's own, which an outage does not extend."""
        return Ride(self.grace, self.where, deadline_of(timeout))

    def _request(self, request: JobRequest | dict | None, fields: dict[str, Any]) -> JobRequest:
        req = flows.make_request(request, fields)
        self.limits.check(req)
        return req

    async def submit(self, request: JobRequest | dict | None = None, /, **fields: Any) -> AsyncJob:
        req = self._request(request, fields)
        ride = self._ride()
        await adrive(self.redis, flows.submit(calls.submit(self.keys, req), self.durability, ride), ride)
        return AsyncJob(self, req.id)

    async def submit_many(self, requests: Iterable[JobRequest | dict]) -> list[AsyncJob]:
        reqs = [self._request(r, {}) for r in requests]
        try:
            ride = self._ride()
            flow = flows.submit_many([calls.submit(self.keys, r) for r in reqs], self.durability, ride)
            ids = await adrive(self.redis, flow, ride)
        except calls.DuplicateJobError as e:
            e.jobs = [AsyncJob(self, i) for i in e.jobs]
            raise
        return [AsyncJob(self, i) for i in ids]

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, job_id)

    async def status(self, job_id: str) -> str:
        return await adrive(self.redis, flows.status(self.keys, job_id), self._ride())

    async def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        return await adrive(self.redis, flows.result(self.keys, job_id, timeout, self.block_chunk_ms),
                            self._ride(timeout))

    def stream(self, job_id: str, timeout: float | None = None, after: str = "0-0", choice: int | None = None
               ) -> AsyncIterator[StreamEvent]:
        """As Client.stream."""
        flow = flows.stream(self.keys, job_id, timeout, after, self.block_chunk_ms, choice)
        return adrive_iter(self.redis, flow, self._ride(timeout))

    async def cancel(self, job_id: str) -> str:
        flow = flows.run_call(calls.cancel(self.keys, job_id, self.result_ttl), self.durability)
        return await adrive(self.redis, flow, self._ride())

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

    def stream(self, timeout: float | None = None, after: str = "0-0", choice: int | None = None
               ) -> AsyncIterator[StreamEvent]:
        return self.client.stream(self.id, timeout, after, choice)

    async def cancel(self) -> str:
        return await self.client.cancel(self.id)

    def __repr__(self) -> str:
        return f"AsyncJob({self.id!r})"
