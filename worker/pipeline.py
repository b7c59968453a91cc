"""Running script calls from the worker's threads: one pipelined round trip, with connection retries."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import redis as redis_lib

from producer import flows
from producer.calls import Call
from producer.durability import Durability
from producer.errors import NotReplicated

log = logging.getLogger("pagedq.worker")
WARN_EVERY_S = 10.0  # a replica that stays away is said once in a while, not once a step

_warned = {"at": float("-inf")}
_warned_lock = threading.Lock()


def run_calls(r, calls: Sequence[Call], retries: int = 5, durability: Durability | None = None) -> list:
    """Each call's outcome (its named result, or its error as a value), in order. Connection errors are
    retried with backoff, then raised: every script is fenced and idempotent, so a retry never writes twice.
    With durability "replicated" the round trip ends with WAIT: NotReplicated (with the outcomes) when too few
    replicas confirmed it."""
    for attempt in range(retries + 1):
        try:
            return flows.drive(r, flows.run_calls(calls, durability))
        except (redis_lib.ConnectionError, redis_lib.TimeoutError) as e:
            if attempt == retries:
                raise
            log.warning("redis unreachable (%s); retrying", e)
            time.sleep(min(0.1 * 2**attempt, 2.0))
    raise AssertionError("unreachable")


def note_unreplicated(e: NotReplicated) -> None:
    """Log a write no replica confirmed in time, at most once every WARN_EVERY_S."""
    now = time.monotonic()
    with _warned_lock:
        if now - _warned["at"] < WARN_EVERY_S:
            return
        _warned["at"] = now
    log.warning("durability replicated: %s", e)


def run_calls_noting(r, calls: Sequence[Call], durability: Durability, metrics, retries: int = 5) -> list:
    """run_calls for writes that need no replica's confirmation to go on (a start, a renewal: a failover that
    loses one only makes the job run again, fenced): a shortfall is logged and counted, and the outcomes used."""
    try:
        return run_calls(r, calls, retries, durability)
    except NotReplicated as e:
        note_unreplicated(e)
        if metrics is not None:
            metrics.not_replicated()
        return e.outcomes
