-- start: a worker takes a job it read from the stream. Sets the job running under a fresh lease token that
-- every later write of the worker must present, and counts the attempt.
--
-- KEYS[1]  job hash      pq:{q}:job:<id>
-- KEYS[2]  jobs stream   pq:{q}:jobs
-- ARGV[1]  consumer group
-- ARGV[2]  stream entry id
-- ARGV[3]  lease token (new, random)
-- ARGV[4]  worker id
-- ARGV[5]  lease duration, milliseconds
-- ARGV[6]  now, unix seconds (the worker's clock, for timings)
--
-- Returns: {"ok", attempts, enqueued_at} when the worker now holds the job;
--          {"skip", state} when it must not run it (cancelled or finished meanwhile, or the entry is a second
--          entry of a job that runs already). A skipped entry is acked and deleted here.
-- Error replies: none.
local state = redis.call('HGET', KEYS[1], 'state')
local entry = redis.call('HGET', KEYS[1], 'entry')
local skip = nil
if state and state ~= 'queued' and state ~= 'running' then
  skip = state
elseif state == 'running' and entry ~= ARGV[2] then
  skip = 'duplicate'
end
if skip then
  redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[2], ARGV[2])
  return {'skip', skip}
end
if not state then
  -- An entry XADDed by hand, not by submit: adopt it, so that its result (likely a failure) has a home.
  redis.call('HSET', KEYS[1], 'enqueued_at', ARGV[6], 'attempts', 0, 'entry', ARGV[2])
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'state', 'running', 'lease', ARGV[3], 'worker', ARGV[4],
  'started_at', ARGV[6], 'lease_until_ms', now_ms + tonumber(ARGV[5]))
return {'ok', attempts, redis.call('HGET', KEYS[1], 'enqueued_at')}
