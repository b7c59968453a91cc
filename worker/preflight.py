"""What a worker checks of its Redis before it loads its model: a Redis that may delete jobs (a maxmemory-policy
other than noeviction) is said loudly, and refused under --strict; a durability the server cannot give (no replica
for "replicated") is refused. Both found in seconds, not after the model loaded."""

from __future__ import annotations

import logging

from producer.connection import connect, redact
from producer.durability import Durability, check_replicas, eviction_policy, eviction_warning

log = logging.getLogger("pagedq.worker")


class Refused(RuntimeError):
    """The worker must not run on this Redis as configured; the message says why and what to change."""


def check(redis_url: str, durability: Durability, strict: bool = False) -> list[str]:
    """Check the Redis at `redis_url`; returns the warnings it logged. Raises Refused."""
    r = connect(redis_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        return check_client(r, durability, strict, redact(redis_url))
    finally:
        r.close()


def check_client(r, durability: Durability, strict: bool = False, where: str = "redis") -> list[str]:
    warnings = []
    evicting = eviction_warning(eviction_policy(r))
    if evicting:
        if strict:
            raise Refused(f"{where}: {evicting}. Refusing to start (--strict)")
        bar = "!" * 100
        log.warning("\n%s\n%s: %s. Starting anyway (--strict refuses).\n%s", bar, where, evicting, bar)
        warnings.append(evicting)
    why = check_replicas(r, durability)
    if why:
        raise Refused(f"{where}: {why}")
    return warnings
