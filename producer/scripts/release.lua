-- release: a worker gives a job it holds back to the queue: a draining worker hands back what it could not
-- finish ("handback"), or a job failed in a way that may pass on another try ("retry"). The job goes to the
-- back of the stream as a new entry with its tokens so far kept, so the next worker resumes it at once
-- instead of after a lease timeout. A job that used up its attempts goes to the dead-letter stream instead.
--
-- KEYS[1]  job hash      pq:{q}:job:<id>
-- KEYS[2]  jobs stream   the stream it was read from (its lane's or its group's: see submit.lua)
-- KEYS[3]  event stream  pq:{q}:events:<id>
-- KEYS[4]  result key    pq:{q}:result:<id>
-- KEYS[5]  dead letters  pq:{q}:dlq
-- KEYS[6]  lane groups   pq:{q}:lane:<lane>:groups (set; touched only for a group's stream)
-- KEYS[7]  lane ready    pq:{q}:lane:<lane>:ready (set; touched only for a group's stream)
-- KEYS[8]  bell          pq:{q}:bell
-- ARGV[1]  consumer group
-- ARGV[2]  stream entry id
-- ARGV[3]  lease token
-- ARGV[4]  handback | retry
-- ARGV[5]  error type (retry: why it failed)
-- ARGV[6]  error message
-- ARGV[7]  max attempts
-- ARGV[8]  TTL of a dead job's result, event stream and hash, seconds
-- ARGV[9]  dead-letter stream cap, entries
-- ARGV[10] worker id
-- ARGV[11] the job's group; "": none
--
-- Returns: {"queued", new entry id} or {"dead", attempts}.
-- Error replies:
--   "LEASE_LOST job <hash key>": the caller no longer holds the job; nothing was written.
local lease, state, attempts, handbacks = unpack(redis.call('HMGET', KEYS[1], 'lease', 'state', 'attempts',
  'handbacks'))
if lease ~= ARGV[3] or state ~= 'running' then
  return redis.error_reply('LEASE_LOST job ' .. KEYS[1])
end
local job_id = string.match(KEYS[1], ':job:(.*)$')
local k = {job = KEYS[1], jobs = KEYS[2], events = KEYS[3], result = KEYS[4], dlq = KEYS[5]}
local e = redis.call('XRANGE', KEYS[2], ARGV[2], ARGV[2])
attempts = tonumber(attempts or 0)
handbacks = tonumber(handbacks or 0)
if ARGV[4] == 'handback' then
  handbacks = handbacks + 1
elseif attempts - handbacks >= tonumber(ARGV[7]) or not e[1] then
  dead_letter(k, job_id, ARGV[2], ARGV[1], ARGV[5], ARGV[6], attempts, ARGV[8], ARGV[9], ARGV[10])
  return {'dead', attempts}
end
if not e[1] then
  -- The entry is gone (trimmed by hand, say): nothing to hand back; the job can only be given up on.
  dead_letter(k, job_id, ARGV[2], ARGV[1], 'entry_lost', 'its stream entry disappeared', attempts, ARGV[8],
    ARGV[9], ARGV[10])
  return {'dead', attempts}
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
local entry = enqueue({stream = KEYS[2], groups = KEYS[6], ready = KEYS[7], bell = KEYS[8], group = ARGV[11]},
  e[1][2])
redis.call('HSET', KEYS[1], 'state', 'queued', 'entry', entry, 'handbacks', handbacks,
  'last_error', ARGV[5] .. ': ' .. ARGV[6])
redis.call('HDEL', KEYS[1], 'lease', 'lease_until_ms')
return {'queued', entry}
