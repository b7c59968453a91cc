-- submit: create a job and append it to the queue's stream, atomically. A job id that exists already is
-- refused, so a retried submit cannot make a second job (idempotency, for as long as the job's keys live).
--
-- KEYS[1]  job hash      pq:{q}:job:<id>
-- KEYS[2]  result key    pq:{q}:result:<id>
-- KEYS[3]  jobs stream   pq:{q}:jobs
-- ARGV[1]  job id
-- ARGV[2]  JobRequest as JSON
-- ARGV[3]  enqueued_at, unix seconds
--
-- Returns: the job's stream entry id.
-- Error replies:
--   "DUPLICATE job <id> exists (state <state>)"
local state = redis.call('HGET', KEYS[1], 'state')
if not state and redis.call('EXISTS', KEYS[2]) == 1 then
  state = 'finished'
end
if state then
  return redis.error_reply('DUPLICATE job ' .. ARGV[1] .. ' exists (state ' .. state .. ')')
end
local entry = redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'job', ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'queued', 'enqueued_at', ARGV[3], 'attempts', 0, 'entry', entry)
return entry
