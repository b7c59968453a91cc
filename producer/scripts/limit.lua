-- limit: the rate limits and the usage counters of one API key of `pagedq serve`, shared by every serve process.
-- Each limit (requests and tokens per minute) is a bucket that refills continuously at its limit per minute and
-- holds a minute's worth at most; a missing bucket is full. "admit" takes one request and the tokens a request
-- is charged (its prompt, estimated, and its max_tokens) only if both buckets hold them (a request charged no
-- tokens, a file's say, passes a key in token debt); "settle" counts what jobs of the key used once they ended,
-- and gives the token bucket back what they were charged beyond that (or takes what they used beyond it).
--
-- KEYS[1]  the buckets  pq:key:{<key id>}:limits  (hash: req, tok, at: ms of the last change; kept for an hour)
-- KEYS[2]  the usage    pq:key:{<key id>}:usage   (hash of counters)
-- ARGV[1]  admit | settle
-- ARGV[2]  requests per minute; 0: no limit
-- ARGV[3]  tokens per minute; 0: no limit
-- ARGV[4]  admit: the tokens charged; settle: the tokens given back (charged minus used; below 0: taken)
-- ARGV[5]  settle: jobs that ended
-- ARGV[6]  settle: their prompt tokens
-- ARGV[7]  settle: their completion tokens
-- ARGV[8]  settle: their cached prompt tokens
--
-- Returns: {1, 0} admitted (counted in `requests`), or settled;
--          {0, ms, limit} refused (counted in `rate_limited`): the buckets hold enough in `ms` milliseconds;
--          `limit` ("requests" or "tokens") is the one that takes longer to refill;
--          {-1, 0, "tokens"} refused (counted in `rate_limited`): the charge is more than a minute's worth.
-- Error replies: none.
local rpm, tpm, tokens = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local b = redis.call('HMGET', KEYS[1], 'req', 'tok', 'at')
local since = math.max(0, now - (tonumber(b[3]) or now))
local function level(held, per_min)
  if not held then
    return per_min
  end
  return math.min(per_min, tonumber(held) + since * per_min / 60000)
end
local req, tok = level(b[1], rpm), level(b[2], tpm)
if ARGV[1] == 'settle' then
  redis.call('HINCRBY', KEYS[2], 'jobs', ARGV[5])
  redis.call('HINCRBY', KEYS[2], 'prompt_tokens', ARGV[6])
  redis.call('HINCRBY', KEYS[2], 'completion_tokens', ARGV[7])
  redis.call('HINCRBY', KEYS[2], 'cached_tokens', ARGV[8])
  if tpm == 0 or tokens == 0 then
    return {1, 0}
  end
  tok = math.min(tpm, tok + tokens)
else
  local wait, short = 0, 'requests'
  if rpm > 0 and req < 1 then
    wait = (1 - req) * 60000 / rpm
  end
  if tpm > 0 and tokens > 0 and tok < tokens then
    local w = (tokens - tok) * 60000 / tpm
    if w > wait then
      wait, short = w, 'tokens'
    end
  end
  if wait > 0 then
    redis.call('HINCRBY', KEYS[2], 'rate_limited', 1)
    if tokens > tpm and tpm > 0 then
      return {-1, 0, 'tokens'}
    end
    return {0, math.ceil(wait), short}
  end
  redis.call('HINCRBY', KEYS[2], 'requests', 1)
  if rpm == 0 and tpm == 0 then
    return {1, 0}
  end
  req, tok = math.max(0, req - 1), tpm > 0 and tok - tokens or 0
end
redis.call('HSET', KEYS[1], 'req', req, 'tok', tok, 'at', now)
redis.call('PEXPIRE', KEYS[1], 3600000)
return {1, 0}
