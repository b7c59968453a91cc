"""A queue's backlog and consumers, for `pagedq status`, the heartbeat's gauges and the dashboard.

Ages come from stream entry ids, which Redis stamps with its own clock, measured against Redis' TIME: no
client's clock enters them. A job handed back or retried is added again, so its age counts from then.
"""

from __future__ import annotations

import redis as redis_lib

from producer.keys import GROUP, Keys


def _ms(entry_id: str) -> int:
    return int(str(entry_id).split("-", 1)[0])


def _age(now_ms: int, entry_id: str | None) -> float | None:
    return None if entry_id is None else round(max(0, now_ms - _ms(entry_id)) / 1000, 3)


def queue_info(r: redis_lib.Redis, keys: Keys) -> dict:
    """length (queued + running), waiting, pending, the oldest job's age (any, delivered, not yet delivered; None
    when there is none), dead letters, and the group's consumers."""
    # TIME names no key, so a cluster pipeline cannot route it: it goes apart (to any node; their clocks agree
    # far better than the ages shown need).
    now_s, now_us = r.time()
    pipe = r.pipeline(transaction=False)
    pipe.xlen(keys.jobs)
    pipe.xrange(keys.jobs, count=1)
    pipe.xlen(keys.dlq)
    length, first, dead = pipe.execute()
    now_ms = int(now_s) * 1000 + int(now_us) // 1000
    try:
        summary = r.xpending(keys.jobs, GROUP)
        group = next((g for g in r.xinfo_groups(keys.jobs) if g["name"] == GROUP), None)
        consumers = r.xinfo_consumers(keys.jobs, GROUP)
    except redis_lib.ResponseError:  # no stream or no group yet: no worker ever joined
        summary, group, consumers = {"pending": 0, "min": None}, None, []
    pending = summary["pending"]
    # Not yet delivered: the entries after the group's last-delivered id (all of them before any worker joined).
    after = f"({group['last-delivered-id']}" if group else "-"
    waiting_first = r.xrange(keys.jobs, min=after, count=1) if length else []
    return {
        "queue": keys.queue,
        "length": length,
        "waiting": max(0, length - pending),
        "pending": pending,
        "oldest_age_s": _age(now_ms, first[0][0] if first else None),
        "oldest_pending_age_s": _age(now_ms, summary.get("min") if pending else None),
        "oldest_waiting_age_s": _age(now_ms, waiting_first[0][0] if waiting_first else None),
        "dead_letters": dead,
        "consumers": [{"name": c["name"], "pending": c["pending"], "idle_ms": c["idle"]} for c in consumers],
    }
