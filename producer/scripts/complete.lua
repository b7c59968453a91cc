-- complete: a worker finishes a job it holds: the last token chunk, the final result (with a TTL), the
-- terminal event, the job's state, and the XACK of its stream entry, in one step, so that no crash can leave a
-- stream with all its tokens but no end. Also used for a running job that ends cancelled or expired. A stream
-- that holds fewer tokens than the worker wrote before the last chunk (a failover lost its last writes) is
-- refused with a GAP: the worker sends the missing chunks again, then completes.
--
-- KEYS[1]  job hash      pq:{q}:job:<id>
-- KEYS[2]  event stream  pq:{q}:events:<id>
-- KEYS[3]  result key    pq:{q}:result:<id>
-- KEYS[4]  jobs stream   the stream the job was read from (its lane's or its group's)
-- ARGV[1]  lease token
-- ARGV[2]  consumer group
-- ARGV[3]  stream entry id
-- ARGV[4]  final state: completed | cancelled | expired
-- ARGV[5]  terminal event type: done | cancelled | error
-- ARGV[6]  JobResult as JSON
-- ARGV[7]  TTL of the result, event stream and job hash, seconds
-- ARGV[8]  last token event JSON, or "" for none
-- ARGV[9]  output tokens before it (with no last chunk: all the job's output tokens)
--
-- Returns: 1 done; 0 done before (a retried call whose reply was lost).
-- Error replies:
--   "LEASE_LOST job <hash key>": the caller no longer holds the job; nothing was written.
--   "GAP <emitted> job <hash key>": the stream holds only <emitted> output tokens, fewer than ARGV[9]; nothing
--   was written.
local lease, state, emitted = unpack(redis.call('HMGET', KEYS[1], 'lease', 'state', 'emitted'))
if lease ~= ARGV[1] then
  return redis.error_reply('LEASE_LOST job ' .. KEYS[1])
end
if state ~= 'running' then
  if state == ARGV[4] then return 0 end
  return redis.error_reply('LEASE_LOST job ' .. KEYS[1])
end
local ttl = tonumber(ARGV[7])
local before = tonumber(ARGV[9])
emitted = tonumber(emitted or 0)
if emitted < before then
  return redis.error_reply('GAP ' .. emitted .. ' job ' .. KEYS[1])
end
if ARGV[8] ~= '' and emitted == before then
  redis.call('XADD', KEYS[2], '*', 'e', ARGV[8], 'o', before)
end
finish({job = KEYS[1], events = KEYS[2], result = KEYS[3], jobs = KEYS[4]}, ARGV[4], ARGV[5], ARGV[6], ttl,
  ARGV[2], ARGV[3])
return 1
