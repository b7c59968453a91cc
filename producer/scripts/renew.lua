-- renew: a worker extends the leases of the jobs it runs, from a timer that does not wait for the engine.
-- XCLAIM ... JUSTID resets each entry's idle time (so no reaper takes it) without counting a delivery.
--
-- KEYS     per job, 2 keys: job hash pq:{q}:job:<id>, and the stream it was read from (its lane's or its group's)
-- ARGV[1]  consumer group
-- ARGV[2]  worker id (the consumer)
-- ARGV[3]  lease duration, milliseconds
-- ARGV[4..] per job, 2 args: lease token, stream entry id
--
-- Returns: per job, in order: 0 renewed; 1 renewed, and a cancel was requested; -1 lease lost (not renewed).
-- Error replies: none.
local out = {}
local until_ms = now_ms() + tonumber(ARGV[3])
for j = 1, #KEYS / 2 do
  local job, stream, a = KEYS[2 * j - 1], KEYS[2 * j], 2 + 2 * j
  local lease, state, cancel = unpack(redis.call('HMGET', job, 'lease', 'state', 'cancel'))
  if lease ~= ARGV[a] or state ~= 'running' then
    out[j] = -1
  else
    redis.call('HSET', job, 'lease_until_ms', until_ms)
    redis.call('XCLAIM', stream, ARGV[1], ARGV[2], 0, ARGV[a + 1], 'JUSTID')
    out[j] = cancel and 1 or 0
  end
end
return out
