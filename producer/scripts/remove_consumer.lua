-- remove_consumer: delete a gone worker's consumer from its queue's group. Deleting a consumer also deletes its
-- pending entries from the group, and an entry that leaves the pending list without an ack is a job no reaper
-- finds again: so the consumer goes only when, atomically, it has nothing pending, has been idle long enough and
-- has no live heartbeat record. A worker that reads a job between a check and the delete cannot exist.
--
-- KEYS[1]  jobs stream       pq:{q}:jobs
-- KEYS[2]  heartbeat record  pq:{q}:worker:<id>
-- ARGV[1]  consumer group
-- ARGV[2]  consumer (the worker id)
-- ARGV[3]  least idle time, milliseconds
--
-- Returns: 1 when the consumer was deleted; 0 when it stays (alive, busy, recently active, or no such group).
-- Error replies: none.
if redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
local ok, consumers = pcall(redis.call, 'XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if not ok then
  return 0
end
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
