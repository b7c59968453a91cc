-- renew: a worker extends the leases of the jobs it runs, from a timer that does not wait for the engine.
-- XCLAIM ... JUSTID resets each entry's idle time (so no reaper takes it) without counting a delivery.
--
-- KEYS[1]  jobs stream   pq:{q}:jobs
-- KEYS[2..] per job: job hash pq:{q}:job:<id>
-- ARGV[1]  consumer group
-- ARGV[2]  worker id (the consumer)
-- ARGV[3]  lease duration, milliseconds
-- ARGV[4..] per job, 2 args: lease token, stream entry id
--
-- Returns: per job, in order: 0 renewed; 1 renewed, and a cancel was requested; -1 lease lost (not renewed).
-- Error replies: none.
local out = {}
local until_ms = now_ms() + tonumber(ARGV[3])
for i = 2, #KEYS do
  local a = 4 + 2 * (i - 2)
  local lease, state, cancel = unpack(redis.call('HMGET', KEYS[i], 'lease', 'state', 'cancel'))
  if lease ~= ARGV[a] or state ~= 'running' then
    out[i - 1] = -1
  else
    redis.call('HSET', KEYS[i], 'lease_until_ms', until_ms)
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[a + 1], 'JUSTID')
    out[i - 1] = cancel and 1 or 0
  end
end
return out
