"""The lease book's Lua scripts (`leases.LeaseBook`) and the lease layout they rely on.

Each script has a WATCH/MULTI fallback in `LeaseBook` for stores that run no
Lua (fakeredis in the embedded demo). A lease is stored as JSON whose last
field is `deadline` (`_with_deadline`): the refresh script splices a new
deadline in there instead of decoding and re-encoding the lease.
"""

from __future__ import annotations

import json
from typing import Any

RELEASE = """
local raw = redis.call('GET', KEYS[1])
if not raw then
  if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'n', ARGV[1])
  end
  return 0
end
local ok, lease = pcall(cjson.decode, raw)
if ok and type(lease) == 'table' and lease['token'] == ARGV[2] then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'n', ARGV[1])
  return 1
end
return 0
"""
BATCH = """
local takes = tonumber(ARGV[1])
local a = 2
for i = 1, takes do
  redis.call('SET', KEYS[2 + i], ARGV[a + 1])
  redis.call('ZADD', KEYS[1], ARGV[a + 2], ARGV[a])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[#ARGV], '*', 'n', ARGV[a])
  a = a + 3
end
local released = 0
for i = takes + 1, #KEYS - 2 do
  local id, token = ARGV[a], ARGV[a + 1]
  a = a + 2
  local raw = redis.call('GET', KEYS[2 + i])
  if not raw then
    if redis.call('ZREM', KEYS[1], id) == 1 then
      redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[#ARGV], '*', 'n', id)
    end
  else
    local ok, lease = pcall(cjson.decode, raw)
    if ok and type(lease) == 'table' and lease['token'] == token then
      redis.call('DEL', KEYS[2 + i])
      redis.call('ZREM', KEYS[1], id)
      redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[#ARGV], '*', 'n', id)
      released = released + 1
    end
  end
end
return released
"""
REFRESH = """
local deadline = ARGV[1]
local seen = {}
for i = 1, #KEYS - 1 do
  local id, token = ARGV[2 * i], ARGV[2 * i + 1]
  local raw = redis.call('GET', KEYS[1 + i])
  seen[i] = 'm'
  if raw then
    seen[i] = 't'
    local ok, lease = pcall(cjson.decode, raw)
    if ok and type(lease) == 'table' and lease['token'] == token then
      local at = string.find(raw, ', "deadline": [%d%.eE%+%-]+}$')
      if at then
        local head = string.sub(raw, 1, at - 1)
        redis.call('SET', KEYS[1 + i], head .. ', "deadline": ' .. deadline .. '}')
        redis.call('ZADD', KEYS[1], deadline, id)
        seen[i] = 'k'
      else
        seen[i] = 'r'
      end
    end
  end
end
return table.concat(seen)
"""
"""Extend the leases whose token is ours; one letter per lease: `k` extended, `t` another
token (taken over), `m` missing, `r` ours but `deadline` is not the last field (Python
rewrites it)."""


def _with_deadline(lease: dict[str, Any], deadline: float) -> dict[str, Any]:
    """`lease` with `deadline` as its last field (where the refresh script finds it)."""
    rest = {k: v for k, v in lease.items() if k != "deadline"}
    return {**rest, "deadline": deadline}


def _sort_by_token(
    ids: list[str], values: list[Any], tokens: dict[str, str]
) -> tuple[list[str], list[str], list[tuple[str, dict[str, Any]]]]:
    """Stored leases as `(taken over, missing, ours)`; an unreadable lease is not ours."""
    taken: list[str] = []
    missing: list[str] = []
    ours: list[tuple[str, dict[str, Any]]] = []
    for task_id, raw in zip(ids, values, strict=True):
        if not raw:
            missing.append(task_id)
            continue
        try:
            lease = json.loads(raw)
        except ValueError:
            lease = None
        if isinstance(lease, dict) and lease.get("token") == tokens[task_id]:
            ours.append((task_id, lease))
        else:
            taken.append(task_id)
    return taken, missing, ours
