"""Reading the heartbeats: which queues exist, which workers are alive on each, and the queue's state beside them.
What `pagedq status`, `pagedq workers` and the dashboard show; one queue's reads stay on its cluster slot.
"""

from __future__ import annotations

import json

import redis as redis_lib

from producer.durability import eviction_policy, eviction_warning
from producer.keys import QUEUES, Keys
from producer.queue_info import queue_info


def known_queues(r: redis_lib.Redis) -> list[str]:
    """Every queue a worker has served (newest heartbeat first)."""
    return list(r.zrevrange(QUEUES, 0, -1))


def live_workers(r: redis_lib.Redis, keys: Keys) -> list[dict]:
    """The heartbeat records of the queue's live workers, by id. A record past its TTL is gone from Redis, so
    liveness is Redis' judgement, not this machine's clock."""
    ids = r.zrange(keys.workers, 0, -1)
    if not ids:
        return []
    records = r.mget([keys.worker(i) for i in ids])  # one slot: MGET is legal on a cluster
    return sorted((json.loads(rec) for rec in records if rec), key=lambda w: w["id"])


def queue_status(r: redis_lib.Redis, queue: str) -> dict:
    """queue_info plus `workers` (live heartbeat records); each consumer says whether it has a heartbeat."""
    keys = Keys(queue)
    info = queue_info(r, keys)
    info["workers"] = live_workers(r, keys)
    alive = {w["id"] for w in info["workers"]}
    for c in info["consumers"]:
        c["alive"] = c["name"] in alive
    return info


def status_of(r: redis_lib.Redis, queues: list[str]) -> list[dict]:
    return [queue_status(r, q) for q in queues]


def all_queues(r: redis_lib.Redis, also: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The registry's queues, plus `also` (a queue asked for by name that no worker has served yet)."""
    seen = known_queues(r)
    return seen + [q for q in also if q not in seen]


def redis_settings(r: redis_lib.Redis) -> dict:
    """What the server promises the queues: its maxmemory-policy and maxmemory (None where this user may not read
    INFO), and a warning when it may evict keys (a job then vanishes without an error)."""
    policy = eviction_policy(r)
    return {**(policy or {"maxmemory_policy": None, "maxmemory": None}), "warning": eviction_warning(policy)}
