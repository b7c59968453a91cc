"""Running script calls from the worker's threads: one pipelined round trip, with connection retries."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis as redis_lib

from producer import flows
from producer.calls import Call

log = logging.getLogger("pagedq.worker")


def run_calls(r, calls: Sequence[Call], retries: int = 5) -> list:
    """Each call's outcome (its named result, or its error as a value), in order. Connection errors are
    retried with backoff, then raised: every script is fenced and idempotent, so a retry never writes twice."""
    for attempt in range(retries + 1):
        try:
            return flows.drive(r, flows.run_calls(calls))
        except (redis_lib.ConnectionError, redis_lib.TimeoutError) as e:
            if attempt == retries:
                raise
            log.warning("redis unreachable (%s); retrying", e)
            time.sleep(min(0.1 * 2**attempt, 2.0))
    raise AssertionError("unreachable")
