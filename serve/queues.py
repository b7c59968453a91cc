"""The serve process's view of its queues: one AsyncClient per queue, all on one bounded Redis connection pool, and
the event readers (serve.events) that follow the jobs its requests wait on.

Short commands (submits, status reads, the Batch API's) share `redis_connections` pooled connections: a command
that finds them all busy waits up to `redis_wait_s` for one (redis-py's BlockingConnectionPool), and past that the
request gets 429 (RedisBusy): the server is overloaded, Redis is not down. On a Redis Cluster the same bound holds
over all nodes together (_WaitingCluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import redis as redis_lib
import redis.asyncio as aredis

from producer import AsyncClient
from producer.connection import (
    AsyncRedisCluster,
    cluster_override,
    connect_async,
    detect_cluster,
    resolve_url,
)
from producer.keys import Keys
from producer.protocol import JobRequest
from serve.config import ServeConfig
from serve.errors import APIError
from serve.events import Bound, EventReaders
from serve.metrics import ServeMetrics
from serve.submits import Submits

CLIENT_NAME = "pagedq-serve"  # CLIENT SETNAME of the pooled connections (CLIENT LIST shows them)
DEPTH_CACHE_S = 0.5  # how long a process reuses a lane's depth it read (counting what it queued meanwhile)
_POOLED_SCHEMES = ("redis", "rediss", "unix")


class RedisBusy(redis_lib.ConnectionError):
    """No pooled connection came free in time: this process has more commands out than connections."""


class _WaitingPool(aredis.BlockingConnectionPool):
    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().get_connection(*args, **kwargs)
        except redis_lib.ConnectionError as e:
            if isinstance(e.__cause__, asyncio.TimeoutError):  # the wait for a free one, not Redis, timed out
                raise RedisBusy(f"all {self.max_connections} Redis connections of this process stayed busy for "
                                f"{self.timeout} s") from e
            raise


class _WaitingCluster(AsyncRedisCluster):
    """redis-py's cluster client refuses a command past its per-node bound on connections (MaxConnectionsError);
    this one lets at most `max_connections` commands out at once over all nodes, and the next waits for a turn
    (RedisBusy after `wait_s`), as the plain pool does."""

    limit = 16  # commands out at once (connect_pool sets both from the settings)
    wait_s = 10.0
    _turns: asyncio.Semaphore | None = None

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        if self._turns is None:
            self._turns = asyncio.Semaphore(self.limit)
        try:
            await asyncio.wait_for(self._turns.acquire(), self.wait_s)
        except asyncio.TimeoutError:
            raise RedisBusy(f"all {self.limit} Redis connections of this process stayed busy for {self.wait_s} s") \
                from None
        try:
            yield
        finally:
            self._turns.release()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self._turn():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = super().pipeline(*args, **kwargs)
        execute = pipe.execute

        async def in_turn(*a: Any, **kw: Any) -> Any:
            async with self._turn():
                return await execute(*a, **kw)

        pipe.execute = in_turn
        return pipe


def connect_pool(config: ServeConfig) -> Any:
    """The process's client: a bounded, waiting pool on a plain Redis; redis-py's cluster client (with per-node
    pools of the same bound) on a cluster; the producer's client for other URL kinds."""
    url = resolve_url(config.redis_url)
    kwargs: dict[str, Any] = {"decode_responses": True, "client_name": CLIENT_NAME}
    cluster = cluster_override()
    if cluster is None and urlsplit(url).scheme in _POOLED_SCHEMES:
        cluster = detect_cluster(url)
    if cluster is False and urlsplit(url).scheme in _POOLED_SCHEMES:
        pool = _WaitingPool.from_url(url, max_connections=config.redis_connections, timeout=config.redis_wait_s,
                                     **kwargs)
        return aredis.Redis.from_pool(pool)
    if cluster:
        kwargs["max_connections"] = config.redis_connections
    client = connect_async(url, cluster=cluster, cluster_class=_WaitingCluster, **kwargs)
    if isinstance(client, _WaitingCluster):
        client.limit, client.wait_s = config.redis_connections, config.redis_wait_s
    return client


class Queues:
    def __init__(self, config: ServeConfig, metrics: ServeMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.redis = connect_pool(config)
        self.events = EventReaders(self.redis, metrics, config.redis_grace_s,
                                   bound=Bound(config.stream_buffer_events, config.stream_buffer_bytes))
        self._clients: dict[str, AsyncClient] = {}
        self._submits: dict[str, Submits] = {}
        self._depths: dict[tuple[str, str], list[float]] = {}  # (queue, lane) -> [depth, read until (monotonic)]
        self.open = 0  # completion requests admitted and not yet answered

    def client(self, queue: str) -> AsyncClient:
        c = self._clients.get(queue)
        if c is None:
            # Its calls (status, cancel) ride through a Redis outage as long as serve's event readers do.
            c = self._clients[queue] = AsyncClient(redis=self.redis, queue=queue, grace=self.config.redis_grace_s)
        return c

    async def submit(self, client: AsyncClient, request: JobRequest) -> None:
        """client.submit(request), in one round trip with the other requests submitting to its queue meanwhile."""
        submits = self._submits.get(client.keys.queue)
        if submits is None:
            submits = self._submits[client.keys.queue] = Submits(client)
        await submits.submit(request)

    def for_model(self, model: str) -> AsyncClient:
        if not self.config.known(model):
            raise APIError(404, f"The model `{model}` does not exist or is not served here", param="model",
                           code="model_not_found")
        return self.client(self.config.queue_of(model))

    def refuse(self, status: int, message: str, reason: str, type: str = "rate_limit_exceeded") -> APIError:
        """The error of a request turned away for `reason` (counted), with Retry-After."""
        self.metrics.refused.labels(reason).inc()
        return APIError(status, message, type, code=reason, headers={"Retry-After": str(self.config.retry_after_s)})

    def admit(self) -> None:
        """Count one more open completion request, or 429 when this process already answers max_open_requests;
        every admit() is paired with one release()."""
        limit = self.config.max_open_requests
        if self.open >= limit:
            raise self.refuse(429, f"this server is answering {self.open} requests, its limit; retry later",
                              "open_requests")
        self.open += 1
        self.metrics.open_requests.set(self.open)

    def release(self) -> None:
        self.open -= 1
        self.metrics.open_requests.set(self.open)

    async def check_depth(self, client: AsyncClient, lane: str) -> None:
        """429 when the job's lane of the queue holds max_queue_depth jobs (queued + running: acked entries are
        deleted). Per lane: a full batch lane never turns away an interactive request."""
        limit = self.config.max_queue_depth
        if limit is None:
            return
        depth = await self.depth(client.keys, lane)
        if depth >= limit:
            self.metrics.queue_full.labels(client.keys.queue, lane).inc()
            raise self.refuse(429, f"the {lane} lane of queue {client.keys.queue} is full ({depth} jobs queued or "
                              f"running, the limit is {limit}); retry later", "queue_full")

    async def depth(self, keys: Keys, lane: str) -> int:
        """The jobs queued or running in the lane: its own stream's and its groups' streams' entries. Read in two
        round trips (the groups, then their streams' lengths) at most every DEPTH_CACHE_S per lane; in between,
        the figure read last plus the jobs this process queued there since."""
        now = time.monotonic()
        cached = self._depths.get((keys.queue, lane))
        if cached is not None and now < cached[1]:
            return int(cached[0])
        pipe = self.redis.pipeline(transaction=False)
        pipe.smembers(keys.lane_groups(lane))
        pipe.xlen(keys.stream(lane))
        groups, depth = await pipe.execute()
        streams = []
        for g in groups:
            with contextlib.suppress(ValueError):  # a name that makes no key holds no job of ours
                streams.append(keys.stream(lane, g))
        if streams:
            pipe = self.redis.pipeline(transaction=False)
            for name in streams:
                pipe.xlen(name)
            depth += sum(await pipe.execute())
        self._depths[(keys.queue, lane)] = [depth, now + DEPTH_CACHE_S]
        return depth

    def submitted(self, client: AsyncClient, lane: str) -> None:
        """This process queued a job on the lane: counted, and in the lane's cached depth."""
        self.metrics.jobs_submitted.labels(lane).inc()
        cached = self._depths.get((client.keys.queue, lane))
        if cached is not None:
            cached[0] += 1

    async def close(self) -> None:
        for submits in self._submits.values():
            await submits.close()
        await self.events.close()
        await self.redis.aclose()


def redis_refusal(e: redis_lib.RedisError, config: ServeConfig, metrics: ServeMetrics) -> APIError:
    """What a request answers when Redis failed it: 429 when this process ran out of connections (Redis is fine,
    the server is full), else 503 naming Redis and what went wrong; both with Retry-After. Counted by reason."""
    retry = {"Retry-After": str(config.retry_after_s)}
    if isinstance(e, (RedisBusy, redis_lib.exceptions.MaxConnectionsError)):
        metrics.refused.labels("redis_busy").inc()
        return APIError(429, f"this server is busy ({e}); retry later", "rate_limit_exceeded", code="server_busy",
                        headers=retry)
    metrics.refused.labels("redis_unavailable").inc()
    reason = f"{type(e).__name__}: {e}"[:300]
    return APIError(503, f"the queue's Redis is unavailable ({reason})", "server_error", code="redis_unavailable",
                    headers=retry)
