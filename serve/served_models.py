"""GET /v1/models: the models configured for this server, and those its queues' live workers serve."""

from __future__ import annotations

import json

from producer.keys import Keys
from serve.config import ServeConfig

CREATED = 0  # OpenAI's `created`; neither configuration nor a heartbeat has such a date


async def served_by_workers(config: ServeConfig, redis) -> dict[str, str]:
    """model name -> queue, from the heartbeats of the live workers of every queue this server routes to."""
    out: dict[str, str] = {}
    for queue in dict.fromkeys([config.queue, *config.routes.values()]):
        keys = Keys(queue)
        ids = await redis.zrange(keys.workers, 0, -1)
        records = await redis.mget([keys.worker(i) for i in ids]) if ids else []
        for rec in filter(None, records):  # a record past its TTL is a dead worker
            info = json.loads(rec)
            for name in info.get("served") or [info.get("model")]:
                if name:
                    out.setdefault(name, queue)
    return out


async def list_models(config: ServeConfig, redis=None) -> list[dict]:
    """The models this server routes, as OpenAI model objects: the configured ones (--model, --route), then
    what live workers serve on the queue a request for that name would go to."""
    queues = {n: config.queue_of(n) for n in [*config.models, *config.routes]}
    if redis is not None:
        for name, queue in (await served_by_workers(config, redis)).items():
            if queue == config.queue_of(name):
                queues.setdefault(name, queue)
    return [{"id": n, "object": "model", "created": CREATED, "owned_by": "pagedq", "queue": q}
            for n, q in queues.items()]
