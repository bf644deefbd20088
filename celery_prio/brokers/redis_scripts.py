"""Lua scripts that make capacity and dead-lettering atomic on Redis.

Tier lists follow kombu: LPUSH adds on the left, consumers RPOP the oldest on
the right. A dead-letter entry is a JSON envelope around the untouched
original message, so that requeueing gives Celery back exactly what it sent.
"""

from __future__ import annotations

#: KEYS: tier list, dead list, stats hash.
#: ARGV: message, cap, policy, tier label, now (epoch s).
#: Returns {accepted (1/0), depth after (or depth seen when refused)}.
GUARDED_PUSH = """
local n = redis.call('LLEN', KEYS[1])
local cap = tonumber(ARGV[2])
if n < cap then
  redis.call('LPUSH', KEYS[1], ARGV[1])
  return {1, n + 1}
end
if ARGV[3] ~= 'drop_oldest' then
  redis.call('HINCRBY', KEYS[3], 'rejected:' .. ARGV[4], 1)
  return {0, n}
end
local evicted = 0
while n >= cap do
  local old = redis.call('RPOP', KEYS[1])
  if not old then break end
  local envelope = cjson.encode({
    headers = {prio_dead_reason = 'drop_oldest', prio_dead_tier = ARGV[4],
               prio_dead_at = tonumber(ARGV[5]), prio_dead_queue = KEYS[1]},
    message = old})
  redis.call('LPUSH', KEYS[2], envelope)
  evicted = evicted + 1
  n = n - 1
end
redis.call('HINCRBY', KEYS[3], 'dropped:' .. ARGV[4], evicted)
redis.call('LPUSH', KEYS[1], ARGV[1])
return {1, n + 1}
"""

#: Move up to ARGV[1] dead entries (oldest first) back to their tier lists,
#: stopping at a full tier. KEYS: dead list. ARGV: count, then pairs of
#: (queue name, cap) for every tier queue. Returns {moved, left}.
DEAD_REQUEUE = """
local caps = {}
for i = 2, #ARGV, 2 do caps[ARGV[i]] = tonumber(ARGV[i + 1]) end
local moved = 0
local limit = tonumber(ARGV[1])
while moved < limit do
  local raw = redis.call('LINDEX', KEYS[1], -1)
  if not raw then break end
  local entry = cjson.decode(raw)
  local queue = entry['headers']['prio_dead_queue']
  local cap = caps[queue]
  if cap and redis.call('LLEN', queue) >= cap then break end
  redis.call('RPOP', KEYS[1])
  redis.call('LPUSH', queue, entry['message'])
  moved = moved + 1
end
return {moved, redis.call('LLEN', KEYS[1])}
"""

#: Move aged messages from the oldest end of a lower tier list to the oldest
#: end of the upper one, each only if it is still where the ager saw it (so
#: two agers never move one message twice) and while the upper tier has room.
#: KEYS: source list, destination list, stats hash.
#: ARGV: destination cap (-1 = none), source tier label, n, n originals
#: (oldest first), n rewritten copies. Returns the number moved.
PROMOTE = """
local cap = tonumber(ARGV[1])
local n = tonumber(ARGV[3])
local moved = 0
for i = 1, n do
  if redis.call('LINDEX', KEYS[1], -1) ~= ARGV[3 + i] then break end
  if cap >= 0 and redis.call('LLEN', KEYS[2]) + moved >= cap then break end
  redis.call('RPOP', KEYS[1])
  moved = moved + 1
end
-- RPUSH the newest first so that the oldest ends up at the consuming end.
for i = moved, 1, -1 do
  redis.call('RPUSH', KEYS[2], ARGV[3 + n + i])
end
if moved > 0 then redis.call('HINCRBY', KEYS[3], 'promoted:' .. ARGV[2], moved) end
return moved
"""

#: Compare-and-set one list element (stamping a message nobody stamped).
#: KEYS: list. ARGV: index, expected, replacement. Returns 1 if set.
STAMP = """
if redis.call('LINDEX', KEYS[1], tonumber(ARGV[1])) ~= ARGV[2] then return 0 end
redis.call('LSET', KEYS[1], tonumber(ARGV[1]), ARGV[3])
return 1
"""

#: Take the oldest message of the first non-empty list and record it as
#: unacked, in one round trip and atomically (kombu does RPOP, then a second
#: call to record it: a crash in between loses the message).
#: KEYS: the lists in preference order, then the unacked hash and index.
#: ARGV: now. Returns {position of the list (1-based), message} or nil.
FETCH = """
local n = #KEYS - 2
for i = 1, n do
  local raw = redis.call('RPOP', KEYS[i])
  if raw then
    local ok, msg = pcall(cjson.decode, raw)
    if ok and type(msg) == 'table' and type(msg['properties']) == 'table' then
      local props = msg['properties']
      local info = props['delivery_info']
      if type(info) ~= 'table' then info = {} end
      local tag = props['delivery_tag']
      if tag then
        redis.call('ZADD', KEYS[n + 2], ARGV[1], tag)
        redis.call('HSET', KEYS[n + 1], tag, '[' .. raw .. ',' .. cjson.encode(info['exchange'] or '') .. ','
          .. cjson.encode(info['routing_key'] or '') .. ']')
      end
    end
    return {i, raw}
  end
end
return nil
"""
