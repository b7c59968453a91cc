"""One serve process's view of its API keys: the key ring (reloaded on SIGHUP), and the Redis side of each key
(serve.tenancy) run on the process's connection, with the process's per-key Prometheus counters."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from producer import flows
from producer.keys import Keys
from producer.protocol import JobRequest, JobResult, Usage
from serve import tenancy
from serve.api_keys import ApiKey, KeyFileError, KeyRing
from serve.config import ServeConfig
from serve.errors import APIError
from serve.metrics import ServeMetrics
from serve.tenancy import Limits, Ticket

log = logging.getLogger("pagedq.serve")
T = TypeVar("T")
# A refusal's error code -> the limit that refused it, as the metrics name it (the rate limits by error type).
_LIMIT_OF_CODE = {"key_queue_full": "jobs", "key_batches_full": "batches", "storage_limit_exceeded": "file_bytes"}


class Tenants:
    def __init__(self, config: ServeConfig, metrics: ServeMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.ring = KeyRing(config.api_keys, config.api_key_file)
        self.registered = False  # the keys' names are in Redis (for `pagedq usage`); again after a reload
        self.redis: Any = None  # the app's connection, once it started

    @property
    def enabled(self) -> bool:
        return self.ring.enabled

    def reload(self) -> None:
        """SIGHUP: read the key file again. A file that does not parse leaves the keys as they were."""
        if not self.ring.path:
            log.info("SIGHUP: no API key file to reload (--api-key-file)")
            return
        try:
            self.ring.reload()
        except KeyFileError as e:
            log.error("API keys not reloaded, the old ones stay: %s", e)
            return
        self.registered = False
        log.info("API keys reloaded: %s", self.describe())

    def describe(self) -> str:
        """The keys by name (never the keys)."""
        keys = self.ring.keys
        return f"{len(keys)} ({', '.join(k.name for k in keys)})" if keys else "none: every request is refused"

    def limits(self, key: ApiKey | None) -> Limits:
        return Limits.of(key, self.config)

    def _limits_of_id(self, key_id: str) -> Limits:
        return self.limits(self.ring.by_id(key_id))  # a key no longer in the ring: no limits, only its counts

    def tally(self, key_id: str, jobs: int, usage: Usage) -> None:
        """Count settled usage in this process's metrics, under the key's name."""
        key = self.ring.by_id(key_id)
        self.metrics.count_usage(key.name if key else key_id, jobs, usage.prompt_tokens, usage.completion_tokens)

    def _refused(self, key: ApiKey, e: APIError) -> APIError:
        limit = _LIMIT_OF_CODE.get(e.code or "", e.type)
        self.metrics.key_rate_limited.labels(key.name, limit).inc()
        return e

    async def limited(self, key: ApiKey | None, work: Awaitable[T]) -> T:
        """`work`'s value; a refusal by one of the key's caps on batches and stored files is counted."""
        try:
            return await work
        except APIError as e:
            if key is not None and e.code in _LIMIT_OF_CODE:
                raise self._refused(key, e) from None
            raise

    async def _run(self, flow: flows.Flow) -> Any:
        return await flows.adrive(self.redis, flow)

    async def admit(self, key: ApiKey | None, tokens: int = 0) -> None:
        """A request of `key` against its rate limits: a 429 when they are reached (nothing without keys)."""
        if key is None:
            return
        try:
            await self._run(tenancy.admit(key, self.limits(key), tokens))
        except APIError as e:
            raise self._refused(key, e) from None

    async def room(self, keys: Keys, key: ApiKey | None) -> None:
        """A 429 when the key has its cap of jobs on the queue already (nothing without keys)."""
        if key is None:
            return
        try:
            await self._run(tenancy.room(keys, key, self.limits(key), self.config.retry_after_s, self.tally))
        except APIError as e:
            raise self._refused(key, e) from None

    async def refund(self, key: ApiKey | None, tokens: int) -> None:
        """Give back the charge of a request refused after its admission. Never raises: the refusal is the answer
        (a charge not given back refills with the bucket)."""
        if key is None:
            return
        try:
            await self._run(tenancy.refund(key, self.limits(key), tokens))
        except Exception:
            log.warning("giving back %d tokens to key %s failed", tokens, key.name, exc_info=True)

    async def submit(self, keys: Keys, req: JobRequest, key: ApiKey, charged: int) -> Ticket:
        """Submit an admitted request's job as the key's, within its cap."""
        try:
            return await self._run(tenancy.submit(keys, req, key, self.limits(key), charged,
                                                  self.config.retry_after_s, self.tally))
        except APIError as e:
            raise self._refused(key, e) from None

    async def settle(self, ticket: Ticket | None, res: JobResult | None) -> None:
        """The submitting request saw its job end. Never raises: the answer is the client's whatever happens here
        (a job whose settling failed before it left the key's set is settled by the sweep)."""
        if ticket is None:
            return
        try:
            u = await self._run(tenancy.settle(ticket, res))
        except Exception:
            log.warning("settling job %s of key %s failed; the sweep will", ticket.job_id, ticket.key.name,
                        exc_info=True)
            return
        if u is not None:
            self.tally(ticket.key.id, 1, u)

    async def upkeep(self, queues: list[str]) -> None:
        """Name the keys in Redis (after a start or a reload), and settle the keys' jobs that ended unseen."""
        if not self.enabled:
            return
        if not self.registered:
            await self._run(tenancy.register(self.ring.keys))
            self.registered = True
        await self._run(tenancy.sweep(queues, self._limits_of_id, self.config.settle_after_s, self.tally))
