-- prune: a worker drops a group's stream that holds no job any more (queued or running: an entry leaves its
-- stream when its job ends), with its consumer group, from the lane. A job queued after it makes it again
-- (submit.lua), so the check and the delete are one step.
--
-- KEYS[1]  jobs stream   pq:{q}:jobs:<lane>:<group>
-- KEYS[2]  lane groups   pq:{q}:lane:<lane>:groups (set)
-- KEYS[3]  lane ready    pq:{q}:lane:<lane>:ready (set)
-- ARGV[1]  the group
--
-- Returns: 1 when the stream was dropped, 0 when it holds entries.
-- Error replies: none.
if redis.call('XLEN', KEYS[1]) > 0 then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
return 1
