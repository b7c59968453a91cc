"""Removing gone workers from a queue's consumer group.

Redis never forgets a consumer: without this, `XINFO CONSUMERS` (and so `pagedq status`) lists every worker
that ever ran. Deleting a consumer also deletes its pending entries from the group's PEL, and an entry that
leaves the PEL without an ack is a job no reaper will ever find again. So a consumer goes only when a script
sees, atomically, that it has nothing pending, has been idle long enough and has no live heartbeat record: a
worker that reads a job between a check and the delete cannot exist, since nothing runs between them.
"""

from __future__ import annotations

import redis as redis_lib

from producer.keys import GROUP, Keys

# KEYS[1] jobs stream, KEYS[2] the consumer's heartbeat record; ARGV[1] group, ARGV[2] consumer, ARGV[3] min idle
# ms. Returns 1 if the consumer was deleted, else 0.
_REMOVE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local ok, consumers = pcall(redis.call, 'XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if not ok then return 0 end
for _, c in ipairs(consumers) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['name'] == ARGV[2] then
    if tonumber(f['pending']) == 0 and tonumber(f['idle']) >= tonumber(ARGV[3]) then
      redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
      return 1
    end
    return 0
  end
end
return 0
"""


def remove_consumer(r: redis_lib.Redis, keys: Keys, name: str, min_idle_ms: int) -> bool:
    """Delete consumer `name` if it holds no pending entry, was idle `min_idle_ms` and has no heartbeat."""
    script = r.register_script(_REMOVE)
    return bool(script(keys=[keys.jobs, keys.worker(name)], args=[GROUP, name, min_idle_ms]))


def prune_dead_consumers(r: redis_lib.Redis, keys: Keys, min_idle_ms: int) -> list[str]:
    """Delete every consumer of the queue's group that looks gone (see remove_consumer); returns their names."""
    try:
        consumers = r.xinfo_consumers(keys.jobs, GROUP)
    except redis_lib.ResponseError:  # no stream or no group yet
        return []
    return [c["name"] for c in consumers
            if c["pending"] == 0 and c["idle"] >= min_idle_ms and remove_consumer(r, keys, c["name"], min_idle_ms)]
