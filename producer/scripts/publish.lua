-- publish: append one step's token chunks to the event streams of several jobs, in one call. Each job's
-- write is guarded by its lease token; the reply also tells the worker which jobs a client asked to cancel,
-- so that cancellation costs no extra round trip.
--
-- KEYS     per job, 2 keys: job hash pq:{q}:job:<id>, event stream pq:{q}:events:<id>
-- ARGV     per job, 2 args: lease token, token event JSON
--
-- Returns: per job, in order, an integer: 0 written; 1 written, and a cancel was requested;
--          -1 lease lost (another worker holds the job, or it finished): nothing written.
-- Error replies: none.
local out = {}
for i = 1, #KEYS / 2 do
  local job, events = KEYS[2 * i - 1], KEYS[2 * i]
  local lease, cancel, state = unpack(redis.call('HMGET', job, 'lease', 'cancel', 'state'))
  if lease ~= ARGV[2 * i - 1] or state ~= 'running' then
    out[i] = -1
  else
    redis.call('XADD', events, '*', 'e', ARGV[2 * i])
    out[i] = cancel and 1 or 0
  end
end
return out
