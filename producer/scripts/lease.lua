-- lease: take, renew or give up a lease: a string key that holds its holder's token, with a TTL. How one process
-- at a time moves a batch of the Batch API on (serve.batch_lease): its sweeper, or the one that submits its jobs;
-- another takes over once the holder stops renewing it. One key: legal on a cluster.
--
-- KEYS[1]  the lease     pq:batch:{<id>}:sweeper | pq:batch:{<id>}:submitting
-- ARGV[1]  the holder's token
-- ARGV[2]  how long it holds, milliseconds; 0: give it up
--
-- Returns: 1 when the token holds the lease now (taken, or renewed: it held it already), or gave it up;
--          0 when another token holds it, or on giving up, when the token did not hold it (nothing written).
-- Error replies: none.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return 0
end
local ms = tonumber(ARGV[2])
if ms == 0 then
  redis.call('DEL', KEYS[1])
  return holder and 1 or 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ms)
return 1
