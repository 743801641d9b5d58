"""The pending set's Lua scripts (`pending.PendingBook`): one round trip per hot operation.

Each has a WATCH/MULTI twin in `PendingBook` for stores that run no Lua (fakeredis in
the embedded demo); tests run both and compare the records.
"""

START = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'unknown' end
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 'stale' end
if state == 'started' then return 'again' end
if state ~= 'assigned' then return 'stale' end
redis.call('HSET', KEYS[1], 'state', 'started', 'started_at', ARGV[2])
redis.call('HDEL', KEYS[1], 'msg')
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[4])
return 'ok'
"""
"""`start` in one round trip (the gate's hot path); `_start_watched` is the same without Lua."""

ASSIGN = """
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'assigned', 'worker', ARGV[1], 'token', ARGV[2],
           'assigned_at', ARGV[3], 'victims', ARGV[4])
redis.call('SADD', KEYS[2], ARGV[5])
if KEYS[3] then redis.call('LPUSH', KEYS[3], ARGV[6]) end
return 1
"""
"""`assign` in one round trip (the leader's hot path); `_cas` is the same without Lua.
With a third key, the message is pushed onto that list too (`assign(push=)`)."""


ADMIT = """
local now, keep, out = ARGV[1], tonumber(ARGV[2]), {}
for i = 2, #KEYS do
  local a = 3 + (i - 2) * 5
  local task_id, msg, meta, msg_id, score = ARGV[a], ARGV[a+1], ARGV[a+2], ARGV[a+3], ARGV[a+4]
  local state = redis.call('HGET', KEYS[i], 'state')
  local raw = redis.call('HGET', KEYS[i], 'seen')
  local seen = {}
  if raw then seen = cjson.decode(raw) end
  local ok = (not state) or state == 'started'
  if ok and msg_id ~= '' then
    for _, s in ipairs(seen) do
      if s == msg_id then ok = false break end
    end
  end
  if ok then
    if msg_id ~= '' then
      seen[#seen + 1] = msg_id
      while #seen > keep do table.remove(seen, 1) end
    end
    redis.call('DEL', KEYS[i])
    redis.call('HSET', KEYS[i], 'state', 'pending', 'msg', msg, 'meta', meta, 'admitted_at', now)
    if #seen > 0 then redis.call('HSET', KEYS[i], 'seen', cjson.encode(seen)) end
    redis.call('ZADD', KEYS[1], score, task_id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""
"""`admit_many` in one round trip (`_admit_watched` is the same without Lua)."""

PRUNE = """
for i, task_id in ipairs(ARGV) do
  local state = redis.call('HGET', KEYS[i + 1], 'state')
  if state ~= 'pending' and state ~= 'assigned' then
    redis.call('ZREM', KEYS[1], task_id)
  end
end
return 0
"""
"""`read`'s index pruning, checked again per job at the moment of removal."""
