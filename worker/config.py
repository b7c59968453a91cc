"""A worker's settings. No import of redis or the engine here: the command line reads its defaults from them."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field

from producer import defaults
from producer.protocol import Limits


def make_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


@dataclass
class WorkerConfig:
    redis_url: str = defaults.REDIS_URL
    queue: str = defaults.QUEUE
    worker_id: str = field(default_factory=make_worker_id)
    result_ttl: int = defaults.RESULT_TTL_S
    lease_ms: int = defaults.LEASE_MS
    max_attempts: int = defaults.MAX_ATTEMPTS
    dlq_cap: int = defaults.DLQ_CAP
    block_ms: int = 1000  # longest idle XREADGROUP BLOCK: how often an idle worker looks at its stop flag
    socket_timeout: float = 10.0  # a Redis reply that takes longer is a dead connection: reconnect
    drain_timeout: float = 30.0  # on stop: how long running jobs may still finish before they are handed back
    served_models: tuple[str, ...] = ()  # names a request's `model` may use; empty: the engine's model name
    limits: Limits = field(default_factory=Limits)
    metrics_port: int | None = None
    heartbeat_s: float = 5.0  # how often the worker's record in Redis is renewed; it lives 3x as long
    durability: str = defaults.DURABILITY  # async | replicated: each write waits for replicas (producer.durability)
    durability_replicas: int = defaults.DURABILITY_REPLICAS
    durability_timeout_ms: int = defaults.DURABILITY_TIMEOUT_MS
    # Of every lane_floor + 1 jobs taken while a lower lane has jobs waiting, at least one is that lane's
    # (worker/intake.py): urgent lanes first, yet a batch is never starved.
    lane_floor: int = 10
    strict: bool = False  # refuse to start on a Redis that may evict keys (a maxmemory-policy but noeviction)
