"""A queue's backlog and consumers, for `pagedq status`, the heartbeat's gauges and the dashboard.

Ages come from stream entry ids, which Redis stamps with its own clock, measured against Redis' TIME: no
client's clock enters them. A job handed back or retried is added again, so its age counts from then.
"""

from __future__ import annotations

import redis as redis_lib

from producer.keys import GROUP, LANES, Keys


def _ms(entry_id: str) -> int:
    return int(str(entry_id).split("-", 1)[0])


def _age(now_ms: int, entry_id: str | None) -> float | None:
    return None if entry_id is None else round(max(0, now_ms - _ms(entry_id)) / 1000, 3)


def _streams(r: redis_lib.Redis, keys: Keys) -> list[tuple[str, str | None]]:
    """Every stream of the queue as (lane, group): the lanes' own, then their groups'."""
    pipe = r.pipeline(transaction=False)
    for lane in LANES:
        pipe.smembers(keys.lane_groups(lane))
    groups = pipe.execute()
    return [(lane, None) for lane in LANES] + [(lane, g) for lane, gs in zip(LANES, groups, strict=True)
                                                for g in sorted(gs)]


def _stream_info(r: redis_lib.Redis, streams: list[str]) -> list[dict]:
    """Per stream: length, pending, its first entry, the oldest pending one, the first not delivered yet, and its
    consumers. Two round trips whatever the number of streams."""
    pipe = r.pipeline(transaction=False)
    for s in streams:
        pipe.xlen(s)
        pipe.xrange(s, count=1)
        pipe.xpending(s, GROUP)
        pipe.xinfo_groups(s)
        pipe.xinfo_consumers(s, GROUP)
    replies = pipe.execute(raise_on_error=False)
    out = []
    for i in range(len(streams)):
        length, first, summary, groups, consumers = replies[5 * i:5 * i + 5]
        if isinstance(summary, Exception):  # no stream or no group yet: no worker ever read it
            summary, groups, consumers = {"pending": 0, "min": None}, [], []
        group = next((g for g in groups if g["name"] == GROUP), None)
        out.append({"length": 0 if isinstance(length, Exception) else length, "first": first or [],
                    "pending": summary["pending"], "min": summary.get("min"), "consumers": consumers,
                    "after": f"({group['last-delivered-id']}" if group else "-"})
    # Not yet delivered: the entries after the group's last-delivered id (all of them before any worker joined).
    pipe = r.pipeline(transaction=False)
    for s, info in zip(streams, out, strict=True):
        pipe.xrange(s, min=info["after"], count=1)
    for info, waiting_first in zip(out, pipe.execute(raise_on_error=False), strict=True):
        info["waiting_first"] = [] if isinstance(waiting_first, Exception) else waiting_first
    return out


def _summary(now_ms: int, infos: list[dict]) -> dict:
    """The backlog of some streams together: counts add up, ages are the oldest's."""
    def oldest(ids: list) -> float | None:
        return _age(now_ms, min(ids, key=_ms)) if ids else None

    length = sum(i["length"] for i in infos)
    pending = sum(i["pending"] for i in infos)
    return {"length": length, "waiting": max(0, length - pending), "pending": pending,
            "oldest_age_s": oldest([i["first"][0][0] for i in infos if i["first"]]),
            "oldest_pending_age_s": oldest([i["min"] for i in infos if i["pending"] and i["min"]]),
            "oldest_waiting_age_s": oldest([i["waiting_first"][0][0] for i in infos if i["waiting_first"]])}


def queue_info(r: redis_lib.Redis, keys: Keys) -> dict:
    """length (queued + running), waiting, pending, the oldest job's age (any, delivered, not yet delivered; None
    when there is none) over every lane and group; the same per lane (`lanes`); dead letters; and the workers'
    consumers (their pending entries summed over the streams)."""
    # TIME names no key, so a cluster pipeline cannot route it: it goes apart (to any node; their clocks agree
    # far better than the ages shown need).
    now_s, now_us = r.time()
    now_ms = int(now_s) * 1000 + int(now_us) // 1000
    streams = _streams(r, keys)
    infos = _stream_info(r, [keys.stream(lane, group) for lane, group in streams])
    consumers: dict[str, dict] = {}
    for info in infos:
        for c in info["consumers"]:
            seen = consumers.setdefault(c["name"], {"name": c["name"], "pending": 0, "idle_ms": c["idle"]})
            seen["pending"] += c["pending"]
            seen["idle_ms"] = min(seen["idle_ms"], c["idle"])
    lanes = {lane: _summary(now_ms, [i for (ln, _), i in zip(streams, infos, strict=True) if ln == lane])
             for lane in LANES}
    for lane in LANES:
        lanes[lane]["groups"] = sum(1 for ln, g in streams if ln == lane and g is not None)
    return {"queue": keys.queue, **_summary(now_ms, infos), "lanes": lanes, "dead_letters": r.xlen(keys.dlq),
            "consumers": sorted(consumers.values(), key=lambda c: c["name"])}
