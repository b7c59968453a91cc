-- take: a worker's intake reads up to ARGV[3] jobs no worker has read yet from one stream of a lane (the lane's
-- own, or a group's). A group's stream whose read finds it drained leaves the lane's ready set in the same step,
-- so a job queued after it (submit.lua adds the group again) cannot go unseen. The consumer group of a group's
-- stream is made here, from its first entry, the first time a worker reads it.
--
-- KEYS[1]  jobs stream   pq:{q}:jobs, pq:{q}:jobs:<lane> or pq:{q}:jobs:<lane>:<group>
-- KEYS[2]  lane ready    pq:{q}:lane:<lane>:ready (set)
-- ARGV[1]  consumer group
-- ARGV[2]  consumer (the worker id)
-- ARGV[3]  most entries to read
-- ARGV[4]  the stream's group; "": a lane's own stream (not in the ready set)
--
-- Returns: the entries read, as XREADGROUP gives them: {{entry id, {field, value, ...}}, ...} (none: {}).
-- Error replies: none.
local group = ARGV[4]
if redis.call('EXISTS', KEYS[1]) == 0 then
  if group ~= '' then
    redis.call('SREM', KEYS[2], group)
  end
  return {}
end
local read = {'XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>'}
local ok, reply = pcall(redis.call, unpack(read))
if not ok then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0')
  reply = redis.call(unpack(read))
end
local entries = reply and reply[1][2] or {}
if group ~= '' and #entries < tonumber(ARGV[3]) then
  redis.call('SREM', KEYS[2], group)
end
return entries
