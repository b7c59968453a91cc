-- submit: create a job and append it to its lane's stream (its group's stream within the lane, when it has a
-- group), atomically. A job id that exists already is refused, so a retried submit cannot make a second job
-- (idempotency, for as long as the job's keys live). `pagedq serve` also names the API key that submits it (its
-- owner) and, for its interactive requests, adds the job to that key's jobs on this queue, refusing it when the
-- key has as many queued or running as it may.
--
-- KEYS[1]  job hash      pq:{q}:job:<id>
-- KEYS[2]  result key    pq:{q}:result:<id>
-- KEYS[3]  jobs stream   the lane's: pq:{q}:jobs (default lane), pq:{q}:jobs:<lane>; a group's:
--                        pq:{q}:jobs:<lane>:<group>
-- KEYS[4]  lane groups   pq:{q}:lane:<lane>:groups (set; touched only for a group's stream)
-- KEYS[5]  lane ready    pq:{q}:lane:<lane>:ready (set; touched only for a group's stream)
-- KEYS[6]  bell          pq:{q}:bell (stream; touched only for a group's stream)
-- KEYS[7]  (optional) the owner's jobs  pq:{q}:owner:<key id>:jobs (sorted set)
-- ARGV[1]  job id
-- ARGV[2]  JobRequest as JSON
-- ARGV[3]  enqueued_at, unix seconds
-- ARGV[4]  the job's group; "": none (KEYS[3] is its lane's own stream)
-- ARGV[5]  (optional) owner: the key id of the API key that submits it; "" or absent: none
-- ARGV[6]  (with KEYS[7]) the most jobs the owner may have in KEYS[7]; 0: no limit
-- ARGV[7]  (with KEYS[7]) the job's member there: "<job id> <tokens charged>" (scored by enqueued_at)
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
if KEYS[7] then
  local cap = tonumber(ARGV[6])
  local n = redis.call('ZCARD', KEYS[7])
  if cap > 0 and n >= cap then
    return redis.error_reply('FULL owner ' .. ARGV[5] .. ' has ' .. n .. ' jobs queued or running (the limit is '
      .. cap .. ')')
  end
  redis.call('ZADD', KEYS[7], ARGV[3], ARGV[7])
end
local entry = enqueue({stream = KEYS[3], groups = KEYS[4], ready = KEYS[5], bell = KEYS[6], group = ARGV[4]},
  {'id', ARGV[1], 'job', ARGV[2]})
redis.call('HSET', KEYS[1], 'state', 'queued', 'enqueued_at', ARGV[3], 'attempts', 0, 'entry', entry,
  'stream', KEYS[3])
if ARGV[5] and ARGV[5] ~= '' then
  redis.call('HSET', KEYS[1], 'owner', ARGV[5])
end
return entry
