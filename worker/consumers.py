"""Removing gone workers from a queue's consumer group.

Redis never forgets a consumer: without this, `XINFO CONSUMERS` (and so `pagedq status`) lists every worker
that ever ran. A consumer goes only through the remove_consumer script (producer/scripts/remove_consumer.lua),
which checks and deletes in one step, so that no pending job leaves the group with it.
"""

from __future__ import annotations

import redis as redis_lib

from producer import calls, flows
from producer.keys import GROUP, Keys


def remove_consumer(r: redis_lib.Redis, keys: Keys, name: str, min_idle_ms: int) -> bool:
    """Delete consumer `name` from each lane's stream where it holds no pending entry, was idle `min_idle_ms` and
    has no heartbeat (a group's stream drops its consumers with it, once empty). True when it left any."""
    return any([flows.drive(r, flows.run_call(calls.remove_consumer(keys, name, min_idle_ms, stream)))
                for stream in keys.lane_streams()])


def prune_dead_consumers(r: redis_lib.Redis, keys: Keys, min_idle_ms: int) -> list[str]:
    """Delete every consumer of the lanes' groups that looks gone (see remove_consumer); returns their names."""
    gone: set[str] = set()
    for stream in keys.lane_streams():
        try:
            consumers = r.xinfo_consumers(stream, GROUP)
        except redis_lib.ResponseError:  # no stream or no group yet
            continue
        gone.update(c["name"] for c in consumers if c["pending"] == 0 and c["idle"] >= min_idle_ms and
                    flows.drive(r, flows.run_call(calls.remove_consumer(keys, c["name"], min_idle_ms, stream))))
    return sorted(gone)
