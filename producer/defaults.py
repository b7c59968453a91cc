"""Defaults shared by the clients, the worker's config and the CLI: each defined here once."""

from __future__ import annotations

REDIS_URL = "redis://localhost:6379/0"
QUEUE = "default"
RESULT_TTL_S = 24 * 3600  # a result, its event stream and its job hash live this long after the job ends
LEASE_MS = 30_000  # a job whose lease is not renewed for this long is taken over by another worker
MAX_ATTEMPTS = 3  # deliveries that did not finish before a job goes to the dead-letter stream
DLQ_CAP = 10_000  # dead letters kept per queue (approximately: MAXLEN ~)
DURABILITY = "async"  # or "replicated": each write waits for replicas (WAIT; producer.durability)
DURABILITY_REPLICAS = 1  # replicated: replicas that must confirm a write
DURABILITY_TIMEOUT_MS = 1000  # replicated: how long one WAIT waits for them
RIDE_GRACE_S = 30.0  # clients retry through a Redis restart or failover this long before giving up (0: never)
