-- submit: create a job and append it to the queue's stream, atomically. A job id that exists already is
-- refused, so a retried submit cannot make a second job (idempotency, for as long as the job's keys live).
-- `pagedq serve` also names the API key that submits it (its owner) and, for its interactive requests, adds the
-- job to that key's jobs on this queue, refusing it when the key has as many queued or running as it may.
--
-- KEYS[1]  job hash      pq:{q}:job:<id>
-- KEYS[2]  result key    pq:{q}:result:<id>
-- KEYS[3]  jobs stream   pq:{q}:jobs
-- KEYS[4]  (optional) the owner's jobs  pq:{q}:owner:<key id>:jobs (sorted set)
-- ARGV[1]  job id
-- ARGV[2]  JobRequest as JSON
-- ARGV[3]  enqueued_at, unix seconds
-- ARGV[4]  (optional) owner: the key id of the API key that submits it; "" or absent: none
-- ARGV[5]  (with KEYS[4]) the most jobs the owner may have in KEYS[4]; 0: no limit
-- ARGV[6]  (with KEYS[4]) the job's member there: "<job id> <tokens charged>" (scored by enqueued_at)
--
-- Returns: the job's stream entry id.
-- Error replies:
--   "DUPLICATE job <id> exists (state <state>)"
--   "FULL owner <key id> has <n> jobs queued or running (the limit is <n>)": nothing was written.
local state = redis.call('HGET', KEYS[1], 'state')
if not state and redis.call('EXISTS', KEYS[2]) == 1 then
  state = 'finished'
end
if state then
  return redis.error_reply('DUPLICATE job ' .. ARGV[1] .. ' exists (state ' .. state .. ')')
end
if KEYS[4] then
  local cap = tonumber(ARGV[5])
  local n = redis.call('ZCARD', KEYS[4])
  if cap > 0 and n >= cap then
    return redis.error_reply('FULL owner ' .. ARGV[4] .. ' has ' .. n .. ' jobs queued or running (the limit is '
      .. cap .. ')')
  end
  redis.call('ZADD', KEYS[4], ARGV[3], ARGV[6])
end
local entry = redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'job', ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'queued', 'enqueued_at', ARGV[3], 'attempts', 0, 'entry', entry)
if ARGV[4] and ARGV[4] ~= '' then
  redis.call('HSET', KEYS[1], 'owner', ARGV[4])
end
return entry
