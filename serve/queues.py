"""The serve process's view of its queues: one AsyncClient per queue, all on one Redis connection pool."""

from __future__ import annotations

from producer import AsyncClient
from producer.connection import connect_async
from serve.config import ServeConfig
from serve.errors import APIError


class Queues:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.redis = connect_async(config.redis_url, decode_responses=True)
        self._clients: dict[str, AsyncClient] = {}

    def client(self, queue: str) -> AsyncClient:
        c = self._clients.get(queue)
        if c is None:
            c = self._clients[queue] = AsyncClient(redis=self.redis, queue=queue)
        return c

    def for_model(self, model: str) -> AsyncClient:
        if not self.config.known(model):
            raise APIError(404, f"The model `{model}` does not exist or is not served here", param="model",
                           code="model_not_found")
        return self.client(self.config.queue_of(model))

    async def check_depth(self, client: AsyncClient) -> None:
        """429 when the queue holds max_queue_depth jobs (queued + running: acked entries are deleted)."""
        limit = self.config.max_queue_depth
        if limit is None:
            return
        depth = await self.redis.xlen(client.keys.jobs)
        if depth >= limit:
            raise APIError(429, f"queue {client.keys.queue} is full ({depth} jobs queued or running, the limit is "
                           f"{limit}); retry later", "rate_limit_exceeded", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)})

    async def close(self) -> None:
        await self.redis.aclose()
