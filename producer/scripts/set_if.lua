-- set_if: set fields of a hash only while one of its fields holds one of the given values: how a batch of the
-- Batch API moves from status to status (serve.batch_store). Two processes that advance one batch at once cannot
-- move it backwards (a slow one writing "in_progress" over "cancelling", say). One key: legal on a cluster.
--
-- KEYS[1]  the hash      pq:batch:{<id>}
-- ARGV[1]  the field compared (a batch's "status")
-- ARGV[2]  n, how many values it may hold
-- ARGV[3..n+2]  the values it may hold
-- ARGV[n+3..]   field, value pairs to set
--
-- Returns: 1 when the fields were set; 0 when the compared field held none of the values (nothing written).
-- Error replies: none.
local n = tonumber(ARGV[2])
local current = redis.call('HGET', KEYS[1], ARGV[1])
local allowed = false
for i = 3, n + 2 do
  if ARGV[i] == current then
    allowed = true
  end
end
if not allowed then
  return 0
end
for i = n + 3, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
return 1
