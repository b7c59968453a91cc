-- retry: an operator sends a dead letter back to the queue. The job starts afresh: its old events and result
-- go, its attempts restart at 0, and the dead letter is removed.
--
-- KEYS[1]  dead letters  pq:{q}:dlq
-- KEYS[2]  job hash      pq:{q}:job:<id>
-- KEYS[3]  event stream  pq:{q}:events:<id>
-- KEYS[4]  result key    pq:{q}:result:<id>
-- KEYS[5]  jobs stream   its lane's or its group's (see submit.lua)
-- KEYS[6]  lane groups   pq:{q}:lane:<lane>:groups (set; touched only for a group's stream)
-- KEYS[7]  lane ready    pq:{q}:lane:<lane>:ready (set; touched only for a group's stream)
-- KEYS[8]  bell          pq:{q}:bell
-- ARGV[1]  dead-letter entry id
-- ARGV[2]  job id
-- ARGV[3]  now, unix seconds (the new enqueued_at)
-- ARGV[4]  the job's group; "": none
--
-- Returns: the job's new stream entry id.
-- Error replies:
--   "NOT_FOUND dead letter <entry id>": no such dead letter.
--   "NO_PAYLOAD dead letter <entry id>": it holds no job JSON (a raw entry without one): nothing to run.
--   "BUSY job <id> is <state>": a job with this id is live again (resubmitted): left alone.
local e = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
if not e[1] then
  return redis.error_reply('NOT_FOUND dead letter ' .. ARGV[1])
end
local f, payload = e[1][2], ''
for i = 1, #f, 2 do
  if f[i] == 'job' then payload = f[i + 1] end
end
if payload == '' then
  return redis.error_reply('NO_PAYLOAD dead letter ' .. ARGV[1])
end
local state = redis.call('HGET', KEYS[2], 'state')
if state and state ~= 'failed' then
  return redis.error_reply('BUSY job ' .. ARGV[2] .. ' is ' .. state)
end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
local entry = enqueue({stream = KEYS[5], groups = KEYS[6], ready = KEYS[7], bell = KEYS[8], group = ARGV[4]},
  {'id', ARGV[2], 'job', payload})
redis.call('HSET', KEYS[2], 'state', 'queued', 'enqueued_at', ARGV[3], 'attempts', 0, 'entry', entry,
  'stream', KEYS[5])
redis.call('XDEL', KEYS[1], ARGV[1])
return entry
