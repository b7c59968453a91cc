-- start: a worker takes a job it read (XREADGROUP) or reclaimed (XAUTOCLAIM) from the stream. Sets the job
-- running under a fresh lease token that every later write of the worker must present, and counts the
-- delivery. A job delivered max_attempts times already (its workers crashed or lost it each time) goes to the
-- dead-letter stream instead. A job whose next delivery is its last one runs alone: a job that kills its
-- workers would otherwise take every job batched with it to the dead-letter stream too.
--
-- KEYS[1]  job hash      pq:{q}:job:<id>
-- KEYS[2]  jobs stream   the stream the job was read from (its lane's or its group's)
-- KEYS[3]  event stream  pq:{q}:events:<id>
-- KEYS[4]  result key    pq:{q}:result:<id>
-- KEYS[5]  dead letters  pq:{q}:dlq
-- ARGV[1]  consumer group
-- ARGV[2]  stream entry id
-- ARGV[3]  lease token (new, random)
-- ARGV[4]  worker id
-- ARGV[5]  lease duration, milliseconds
-- ARGV[6]  now, unix seconds (the worker's clock, for timings)
-- ARGV[7]  max attempts
-- ARGV[8]  TTL of a dead job's result, event stream and hash, seconds
-- ARGV[9]  dead-letter stream cap, entries
-- ARGV[10] 1 if the worker runs nothing else and will take nothing else while this job runs, else 0
--
-- Returns: {"ok", attempts, enqueued_at, emitted} when the worker now holds the job (emitted: output tokens
--          its event stream holds already, to resume from);
--          {"skip", state} when it must not run it (cancelled or finished meanwhile, or a second entry of a
--          job that runs already): the entry is acked and deleted here;
--          {"busy"} when another worker's lease on it is still live (the reclaim came early): nothing changed,
--          and that worker's next renewal takes the entry back;
--          {"dead", attempts} when it went to the dead-letter stream;
--          {"later"} when this would be its last delivery after failed ones and ARGV[10] is 0: nothing changed;
--          the worker must start it again once it runs nothing else.
-- Error replies: none.
local state, entry, attempts, handbacks, until_ms = unpack(redis.call('HMGET', KEYS[1], 'state', 'entry',
  'attempts', 'handbacks', 'lease_until_ms'))
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
local now = now_ms()
if state == 'running' and tonumber(until_ms or 0) > now then
  return {'busy'}
end
if not state then
  -- An entry XADDed by hand, not by submit: adopt it, so that its result (likely a failure) has a home.
  redis.call('HSET', KEYS[1], 'enqueued_at', ARGV[6], 'attempts', 0, 'entry', ARGV[2])
  attempts = 0
end
attempts = tonumber(attempts or 0)
-- Hand-backs of a draining worker are deliveries too, but no fault of the job's.
local failed = attempts - tonumber(handbacks or 0)
local max_attempts = tonumber(ARGV[7])
if failed >= max_attempts then
  local k = {job = KEYS[1], jobs = KEYS[2], events = KEYS[3], result = KEYS[4], dlq = KEYS[5]}
  local job_id = string.match(KEYS[1], ':job:(.*)$')
  dead_letter(k, job_id, ARGV[2], ARGV[1], 'max_attempts',
    'delivered ' .. attempts .. ' times without finishing (its workers crashed or lost the lease)',
    attempts, ARGV[8], ARGV[9], ARGV[4])
  return {'dead', attempts}
end
local last_chance = failed >= 1 and failed == max_attempts - 1
if last_chance and ARGV[10] ~= '1' then
  return {'later'}
end
attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'state', 'running', 'lease', ARGV[3], 'worker', ARGV[4],
  'started_at', ARGV[6], 'lease_until_ms', now + tonumber(ARGV[5]))
local emitted = redis.call('HGET', KEYS[1], 'emitted') or 0
return {'ok', attempts, redis.call('HGET', KEYS[1], 'enqueued_at'), tonumber(emitted)}
