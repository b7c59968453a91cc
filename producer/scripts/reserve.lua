-- reserve: take room for an item in a budget of an API key of `pagedq serve`: a sorted set of "<item id> <size>"
-- members, each scored by when its item expires (unix seconds). The bytes of the files a key stores and the
-- batches it has not seen end (each of size 1) are two such budgets. Members past their expiry leave first; an
-- item that holds room already keeps it (two processes that write one batch's output file count it once).
--
-- KEYS[1]  the budget   pq:key:{<key id>}:files | pq:key:{<key id>}:batches
-- ARGV[1]  now, unix seconds
-- ARGV[2]  the cap: the most the sizes may sum to; 0: no cap
-- ARGV[3]  the member, "<item id> <size>"
-- ARGV[4]  its size
-- ARGV[5]  its expiry, unix seconds
--
-- Returns: {1, total} reserved (or held already): `total` is the sizes summed, this item's included;
--          {0, total} refused: the other items' sizes sum to `total`, and this one would pass the cap.
-- Error replies: none.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])
local total = 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  total = total + tonumber(string.match(member, ' (%d+)$'))
end
local cap, size = tonumber(ARGV[2]), tonumber(ARGV[4])
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then
  redis.call('ZADD', KEYS[1], ARGV[5], ARGV[3])
  return {1, total}
end
if cap > 0 and total + size > cap then
  return {0, total}
end
redis.call('ZADD', KEYS[1], ARGV[5], ARGV[3])
return {1, total + size}
