"""What pagedq can promise depends on the Redis it runs on: durability levels, and the eviction check.

Durability, for the clients and the worker alike:
- "async" (the default): a write is done when the primary has it. Replication is asynchronous, so a failover
  that promotes a replica which lacks the last writes loses them: a submitted job, a result.
- "replicated": every round trip of state-changing scripts ends with `WAIT <replicas> <timeout_ms>` on the same
  connection, and the write counts as done only once that many replicas confirmed it. A submit is acknowledged
  to the producer only then (else NotReplicated). A worker publishes a job's end either way (the result is
  readable), and one no replica confirmed it sends again, idempotently, until one does, saying loudly meanwhile
  that it is unreplicated (docs/guarantees.md, "When no replica confirms"). Costs a replica's round trip per write; needs that many
  replicas attached (checked at the worker's start). Not on a Redis Cluster: WAIT names no key, so a cluster
  client cannot send it down the connection that carried the scripts.

Eviction: a Redis whose `maxmemory-policy` is anything but `noeviction` may delete keys when it runs out of
memory: a queued job's stream entry, a running job's hash, a result. Jobs then vanish without an error, so the
worker warns loudly at start (refuses with --strict) and `pagedq status` says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoPermissionError, ResponseError

from producer import defaults
from producer.connection import is_cluster
from producer.errors import NotReplicated

ASYNC = "async"
REPLICATED = "replicated"
LEVELS = (ASYNC, REPLICATED)
ENV = "PAGEDQ_DURABILITY"
ENV_REPLICAS = "PAGEDQ_DURABILITY_REPLICAS"
ENV_TIMEOUT_MS = "PAGEDQ_DURABILITY_TIMEOUT_MS"
NOEVICTION = "noeviction"


@dataclass(frozen=True)
class Durability:
    level: str = defaults.DURABILITY
    replicas: int = defaults.DURABILITY_REPLICAS  # replicated: how many replicas must confirm a write
    timeout_ms: int = defaults.DURABILITY_TIMEOUT_MS  # replicated: how long one WAIT waits for them

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"durability must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if self.replicas < 1:
            raise ValueError(f"durability replicas must be at least 1, got {self.replicas}")
        if self.timeout_ms < 1:  # WAIT 0 would block for ever
            raise ValueError(f"durability timeout must be at least 1 ms, got {self.timeout_ms}")

    @property
    def replicated(self) -> bool:
        return self.level == REPLICATED

    @classmethod
    def of(cls, value: Durability | str | None = None) -> Durability:
        """`value` as a Durability: a level name takes the replicas and timeout from the environment; None takes
        the level too ($PAGEDQ_DURABILITY, else async)."""
        if isinstance(value, Durability):
            return value
        level = value or os.environ.get(ENV) or defaults.DURABILITY
        return cls(level, int(os.environ.get(ENV_REPLICAS) or defaults.DURABILITY_REPLICAS),
                   int(os.environ.get(ENV_TIMEOUT_MS) or defaults.DURABILITY_TIMEOUT_MS))

    def wait_args(self) -> tuple:
        """The WAIT command that follows a round trip of writes (replicated only)."""
        return ("WAIT", self.replicas, self.timeout_ms)

    def check(self, acked: Any, outcomes: list, ids: list[str]) -> None:
        """Raise NotReplicated unless WAIT's reply `acked` counts enough replicas (an error reply counts none)."""
        if isinstance(acked, Exception):
            why, acked = f"WAIT failed: {acked}", 0
        else:
            acked = int(acked)
            why = f"{acked} of {self.replicas} replicas confirmed it within {self.timeout_ms} ms"
        if acked < self.replicas:
            what = f"job {', '.join(ids)}" if ids else "the write"
            raise NotReplicated(f"{what}: the primary has it, but {why}: a failover now could lose it "
                                f"(durability replicated)", acked, self.replicas, outcomes, ids)


ASYNC_DURABILITY = Durability()


def online_replicas(r) -> int:
    """Replicas attached to the primary `r` talks to and in sync (INFO replication: state=online)."""
    info = r.info("replication")
    return sum(1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
               and v.get("state") == "online")


def check_replicas(r, durability: Durability) -> str | None:
    """None when `durability` can be met now; else why not, in a sentence that says what to do."""
    if not durability.replicated:
        return None
    if is_cluster(r):
        return ("durability replicated is not supported on a Redis Cluster (WAIT names no key, so it cannot follow "
                "a queue's scripts to their node): use a primary with replicas behind Sentinel, or async")
    have = online_replicas(r)
    if have < durability.replicas:
        return (f"durability replicated needs {durability.replicas} replica(s) attached to the primary and in "
                f"sync, and it has {have}: attach one (`replicaof`), or run with durability async")
    return None


def eviction_policy(r) -> dict[str, Any] | None:
    """{"maxmemory_policy", "maxmemory"} of the server `r` talks to (of each primary on a cluster: the first
    that evicts, else the first), or None when this user may not read INFO."""
    try:
        if is_cluster(r):
            infos = list(r.info("memory", target_nodes=r.PRIMARIES).values())
        else:
            infos = [r.info("memory")]
    except (NoPermissionError, ResponseError):
        return None
    found = [{"maxmemory_policy": i.get("maxmemory_policy", "unknown"), "maxmemory": int(i.get("maxmemory", 0))}
             for i in infos if isinstance(i, dict)]
    return next((f for f in found if f["maxmemory_policy"] != NOEVICTION), found[0] if found else None)


def eviction_warning(policy: dict[str, Any] | None) -> str | None:
    """The warning for a server that may evict keys; None for noeviction (or when INFO could not be read)."""
    if policy is None or policy["maxmemory_policy"] == NOEVICTION:
        return None
    limit = f"maxmemory {policy['maxmemory']} bytes" if policy["maxmemory"] else "no maxmemory set yet"
    return (f"Redis maxmemory-policy is {policy['maxmemory_policy']} ({limit}), not noeviction: when it runs out "
            f"of memory it deletes keys, and a deleted job stream entry, job hash or result is a job lost without "
            f"an error. Set `maxmemory-policy noeviction` (writes then fail loudly instead)")
