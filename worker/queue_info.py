"""A queue's backlog and consumers, for `pagedq status` (and whoever else asks)."""

from __future__ import annotations

import redis as redis_lib

from producer.keys import GROUP, Keys


def queue_info(r: redis_lib.Redis, keys: Keys) -> dict:
    length = r.xlen(keys.jobs)  # acked entries are deleted: this is queued + running
    try:
        pending = r.xpending(keys.jobs, GROUP)["pending"]
        consumers = r.xinfo_consumers(keys.jobs, GROUP)
    except redis_lib.ResponseError:  # no stream or no group yet: no worker ever joined
        pending, consumers = 0, []
    return {
        "queue": keys.queue,
        "length": length,
        "waiting": max(0, length - pending),
        "pending": pending,
        "consumers": [{"name": c["name"], "pending": c["pending"], "idle_ms": c["idle"]} for c in consumers],
    }
