-- fail: a worker gives up on a job it holds (invalid request, engine error): the failed result (with a TTL),
-- the terminal "error" event, the job's state, and the XACK of its stream entry, in one step.
--
-- KEYS[1]  job hash      pq:{q}:job:<id>
-- KEYS[2]  event stream  pq:{q}:events:<id>
-- KEYS[3]  result key    pq:{q}:result:<id>
-- KEYS[4]  jobs stream   the stream the job was read from (its lane's or its group's)
-- ARGV[1]  lease token
-- ARGV[2]  consumer group
-- ARGV[3]  stream entry id
-- ARGV[4]  JobResult as JSON (status failed, error set)
-- ARGV[5]  TTL of the result, event stream and job hash, seconds
--
-- Returns: 1 done; 0 done before (a retried call whose reply was lost).
-- Error replies:
--   "LEASE_LOST job <hash key>": the caller no longer holds the job; nothing was written.
local lease, state = unpack(redis.call('HMGET', KEYS[1], 'lease', 'state'))
if lease ~= ARGV[1] then
  return redis.error_reply('LEASE_LOST job ' .. KEYS[1])
end
if state ~= 'running' then
  if state == 'failed' then return 0 end
  return redis.error_reply('LEASE_LOST job ' .. KEYS[1])
end
local ttl = tonumber(ARGV[5])
finish({job = KEYS[1], events = KEYS[2], result = KEYS[3], jobs = KEYS[4]}, 'failed', 'error', ARGV[4], ttl,
  ARGV[2], ARGV[3])
return 1
