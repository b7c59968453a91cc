"""A worker's heartbeat: its record in Redis with a TTL, one stats interval, and the queue gauges.

The lease thread calls `beat()` every `interval_s`. The record lives `3 * interval_s`, so one or two late beats
(a slow Redis, a GC pause) do not make a live worker vanish, and a dead one disappears within one TTL without
anyone cleaning up. The same round trip appends the interval's tokens and TTFT/TPOT bucket counts to the
queue's stats stream (trimmed to the last hour), which is where the dashboard's charts come from.

With durability replicated the record says `unreplicated_since` (a wall time) while no replica confirms this
worker's writes: its job ends are published on the primary alone (docs/guarantees.md). null otherwise.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import redis as redis_lib

from producer.keys import QUEUES, Keys
from producer.queue_info import queue_info
from worker.consumers import prune_dead_consumers, remove_consumer
from worker.metrics import Metrics

log = logging.getLogger("pagedq.worker")

HISTORY_S = 3600  # stats kept per queue
PRUNE_EVERY_S = 60.0  # how often a worker looks for dead consumers in its queue's group


class Heartbeat:
    def __init__(self, r: redis_lib.Redis, keys: Keys, worker_id: str, info: dict[str, Any], interval_s: float,
                 metrics: Metrics, state: Callable[[], dict[str, Any]], lease_ms: int) -> None:
        """`info`: what never changes (model, device, ...); `state()`: what does (running, KV blocks, ...)."""
        self.r, self.keys, self.id, self.metrics, self.state = r, keys, worker_id, metrics, state
        self.interval_s = interval_s
        self.ttl_ms = max(1000, int(3 * interval_s * 1000))
        # A consumer idle this long with nothing pending and no heartbeat is a worker that is gone: live workers
        # read at least every block_ms (1 s), so this leaves a wide margin.
        self.prune_idle_ms = max(60_000, 2 * lease_ms, 2 * self.ttl_ms)
        self.info = {"id": worker_id, "queue": keys.queue, "started_at": time.time(), **info}
        self.last = time.monotonic()
        self.next_prune = 0.0

    def beat(self) -> None:
        now, mono = time.time(), time.monotonic()
        dt, self.last = max(mono - self.last, 1e-6), mono
        tokens, ttft, tpot = self.metrics.window.take()
        state = self.state()
        # The publisher logs when confirmations stop and resume; the record says it to status and the dashboard.
        record = {**self.info, **state, "unreplicated_since": self.metrics.unreplicated_since(), "tokens_per_s": round(tokens / dt, 2), "interval_s": self.interval_s,
                  "ttl_s": self.ttl_ms / 1000, "updated_at": now}
        now_ms = int(now * 1000)
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.keys.worker(self.id), json.dumps(record), px=self.ttl_ms)
        pipe.zadd(self.keys.workers, {self.id: now_ms + self.ttl_ms})
        pipe.zremrangebyscore(self.keys.workers, "-inf", now_ms - self.ttl_ms)  # the long dead; readers check TTLs
        pipe.xadd(self.keys.stats, {"w": self.id, "t": f"{now:.3f}", "dt": f"{dt:.3f}", "tokens": tokens,
                                    "ttft": json.dumps(ttft), "tpot": json.dumps(tpot)},
                  minid=str(now_ms - HISTORY_S * 1000), approximate=True)
        pipe.zadd(QUEUES, {self.keys.queue: now_ms})  # another slot on a cluster: the pipeline splits it off
        pipe.execute()
        self.metrics.queue_state(queue_info(self.r, self.keys))
        if mono >= self.next_prune:
            self.next_prune = mono + PRUNE_EVERY_S
            pruned = prune_dead_consumers(self.r, self.keys, self.prune_idle_ms)
            if pruned:
                log.info("removed %d dead consumers from the group: %s", len(pruned), ", ".join(pruned))

    def remove(self) -> None:
        """On a clean exit: the record goes at once, and so does our consumer (once nothing is pending on it)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.keys.worker(self.id))
        pipe.zrem(self.keys.workers, self.id)
        pipe.execute()
        remove_consumer(self.r, self.keys, self.id, min_idle_ms=0)
