"""Run a list of EVALSHA calls as one pipelined round trip, loading the scripts if Redis lost them."""

from __future__ import annotations

import logging
import time

import redis as redis_lib
from redis.exceptions import NoScriptError

from producer.scripts import Scripts

log = logging.getLogger("pagedq.worker")


def evalsha_all(r: redis_lib.Redis, scripts: Scripts, calls: list[tuple], retries: int = 5) -> list:
    """`calls`: (script name, keys, args) each. Replies in order; a script's error reply comes back as a
    ResponseError instance, not raised. Connection errors are retried with backoff, then raised."""
    for attempt in range(retries + 1):
        pipe = r.pipeline(transaction=False)
        for name, keys, args in calls:
            pipe.evalsha(scripts.sha(name), len(keys), *keys, *args)
        try:
            replies = pipe.execute(raise_on_error=False)
        except (redis_lib.ConnectionError, redis_lib.TimeoutError) as e:
            if attempt == retries:
                raise
            log.warning("redis unreachable (%s); retrying", e)
            time.sleep(min(0.1 * 2**attempt, 2.0))
            continue
        if any(isinstance(x, NoScriptError) for x in replies) and attempt < retries:
            # Redis restarted or SCRIPT FLUSH: NOSCRIPT means nothing of that call ran, so running it again is safe.
            scripts.load_all(r)
            retry = [c for c, x in zip(calls, replies, strict=True) if isinstance(x, NoScriptError)]
            again = iter(evalsha_all(r, scripts, retry, retries - attempt - 1))
            return [next(again) if isinstance(x, NoScriptError) else x for x in replies]
        return replies
    raise AssertionError("unreachable")
