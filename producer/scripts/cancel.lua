-- cancel: a client cancels a job. A queued job is cancelled here and now (result, terminal event, its stream
-- entry deleted); a running job gets a cancel flag, which the worker learns from its next publish and then
-- finishes the job as cancelled.
--
-- KEYS[1]  job hash      pq:{q}:job:<id>
-- KEYS[2]  event stream  pq:{q}:events:<id>
-- KEYS[3]  result key    pq:{q}:result:<id>
-- KEYS[4]  jobs stream   pq:{q}:jobs (a queued job's entry is deleted when it is on this stream; one on another
--                        lane's or group's stream stays, and the worker that reads it skips it: start.lua)
-- ARGV[1]  JobResult as JSON for a queued job (status cancelled)
-- ARGV[2]  TTL of the result, event stream and job hash, seconds
--
-- Returns: "cancelled" (it was queued), "cancelling" (it runs; the worker will stop it), or the job's
--          terminal state, unchanged ("completed", "failed", "cancelled", "expired").
-- Error replies:
--   "NOT_FOUND job <hash key>": no such job (never submitted, or its keys expired).
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return redis.error_reply('NOT_FOUND job ' .. KEYS[1])
end
if state == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', 1)
  return 'cancelling'
end
if state ~= 'queued' then
  return state
end
local ttl = tonumber(ARGV[2])
-- Not acked: a worker that read the entry already skips it at start (and acks it); one that has not never sees it.
local entry, stream = unpack(redis.call('HMGET', KEYS[1], 'entry', 'stream'))
if stream and stream ~= KEYS[4] then
  entry = nil
end
finish({job = KEYS[1], events = KEYS[2], result = KEYS[3], jobs = KEYS[4]}, 'cancelled', 'cancelled', ARGV[1], ttl,
  nil, entry)
return 'cancelled'
