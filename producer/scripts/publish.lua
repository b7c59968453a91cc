-- publish: append one step's token chunks to the event streams of several jobs, in one call. Each job's
-- write is guarded by its lease token and by its token offset: a chunk is written only if the stream holds
-- exactly `offset` output tokens before it, so a retried call (the reply was lost) writes nothing twice, and a
-- stream that lost its last writes (a failover promoted a replica that lacked them) gets them again, in order,
-- from the worker that still holds the job. The reply also tells the worker which jobs a client asked to
-- cancel, so cancellation costs no extra round trip.
--
-- KEYS     per job, 2 keys: job hash pq:{q}:job:<id>, event stream pq:{q}:events:<id>
-- ARGV     per chunk, 4 args: lease token, offset (output tokens before this chunk), number of tokens in it,
--          token event JSON.
-- Each entry holds the event (e) and its offset (o): a reader that followed the stream live across a failover
-- skips the chunks written again that it had read already (producer.flows.Repeats).
--
-- Returns: per chunk, in order: 0 written (or written before); 1 the same, and a cancel was requested; -1
--          refused: lease lost (another worker holds the job, or it finished): nothing written; {emitted}, a
--          one-element array, for a gap: the stream holds only `emitted` tokens, fewer than `offset` (its last
--          writes were lost): nothing written; the worker sends its chunks again from there.
-- Error replies: none.
local out = {}
for i = 1, #KEYS / 2 do
  local job, events = KEYS[2 * i - 1], KEYS[2 * i]
  local a = 4 * (i - 1)
  local lease, cancel, state, emitted = unpack(redis.call('HMGET', job, 'lease', 'cancel', 'state', 'emitted'))
  emitted = tonumber(emitted or 0)
  local offset, n, ev = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), ARGV[a + 4]
  if lease ~= ARGV[a + 1] or state ~= 'running' then
    out[i] = -1
  elseif emitted < offset then
    out[i] = {emitted}
  else
    if emitted == offset then
      redis.call('XADD', events, '*', 'e', ev, 'o', offset)
      redis.call('HSET', job, 'emitted', offset + n)
    end
    out[i] = cancel and 1 or 0
  end
end
return out
