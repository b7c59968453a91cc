-- lib: helpers prepended to every script (scripts.py joins them), so that a dead letter is written the same
-- way wherever a job is given up on.
--
-- finish(k, state, event, res, ttl, group, entry)
--   The one way a job ends: its result `res` (JSON, with `ttl`), its terminal event of type `event`, its final
--   state; its keys expire with the result; its stream entry is acked (when `group` is given) and deleted.
--
-- dead_letter(k, job_id, entry, group, etype, reason, attempts, ttl, cap, worker)
--   k: {job=, jobs=, events=, result=, dlq=} key names. Copies the job's payload from its stream entry to the
--   dead-letter stream (capped near `cap` entries), writes the failed result and the terminal "error" event
--   (with `ttl`), and acks and deletes the entry. Returns the result JSON.
--
-- enqueue(q, fields)
--   q: {stream=, groups=, ready=, bell=, group=} (the lane's keys; group "" for a lane's own stream). Appends
--   `fields` to the stream; a group's stream is registered in its lane, marked ready and the bell rung, so that
--   every worker's intake finds it. Returns the entry id.
local function enqueue(q, fields)
  local entry = redis.call('XADD', q.stream, '*', unpack(fields))
  if q.group ~= '' then
    redis.call('SADD', q.groups, q.group)
    redis.call('SADD', q.ready, q.group)
    redis.call('XADD', q.bell, 'MAXLEN', 16, '*', 'g', q.group)
  end
  return entry
end

local function finish(k, state, event, res, ttl, group, entry)
  redis.call('SET', k.result, res, 'EX', ttl)
  redis.call('XADD', k.events, '*', 'e', '{"type":"' .. event .. '","result":' .. res .. '}')
  redis.call('EXPIRE', k.events, ttl)
  redis.call('HSET', k.job, 'state', state)
  redis.call('HDEL', k.job, 'lease_until_ms', 'cancel')
  redis.call('EXPIRE', k.job, ttl)
  if entry then
    if group then redis.call('XACK', k.jobs, group, entry) end
    redis.call('XDEL', k.jobs, entry)
  end
end

local function dead_letter(k, job_id, entry, group, etype, reason, attempts, ttl, cap, worker)
  local payload = ''
  local e = redis.call('XRANGE', k.jobs, entry, entry)
  if e[1] then
    local f = e[1][2]
    for i = 1, #f, 2 do
      if f[i] == 'job' then payload = f[i + 1] end
    end
  end
  local t = redis.call('TIME')
  redis.call('XADD', k.dlq, 'MAXLEN', '~', cap, '*', 'id', job_id, 'error', etype, 'reason', reason,
    'attempts', attempts, 'worker', worker, 'at', t[1], 'job', payload)
  local res = cjson.encode({id = job_id, status = 'failed', finish_reason = 'error', attempts = tonumber(attempts),
    worker = worker, error = {type = etype, message = reason}})
  finish(k, 'failed', 'error', res, ttl, group, entry)
  return res
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

