-- Publish many messages to one tier list in one call, under its cap.
-- ``reject``: push while the list is below the cap, stop at the first that
-- does not fit (the caller reports how many went in). ``drop_oldest``: push
-- all, evicting the oldest to the dead letters as needed.
-- The tier's doorbell rings once per message taken (up to its bound).
-- KEYS: tier list, dead list, stats hash, the tier's bell, the index of lists with work ('' = none).
-- ARGV: cap (-1 = none), policy, tier label, now, then the messages.
-- Returns {accepted, depth after}.
--#include dead_entry
--#include ring
--#include mark_ready

local cap = tonumber(ARGV[1])
local n = redis.call('LLEN', KEYS[1])
local count = #ARGV - 4
if cap < 0 or n + count <= cap then  -- room for all: LPUSHes of at most UNPACK_MAX messages each
  -- (Lua's unpack fails beyond its stack limit, about 8,000 values: a larger chunk is pushed in parts)
  local UNPACK_MAX = 4000
  for first = 5, #ARGV, UNPACK_MAX do
    redis.call('LPUSH', KEYS[1], unpack(ARGV, first, math.min(first + UNPACK_MAX - 1, #ARGV)))
  end
  mark_ready(KEYS[5], KEYS[1])
  ring(KEYS[4], count)
  return {count, n + count}
end
local accepted, evicted = 0, 0
for i = 5, #ARGV do
  if cap >= 0 and n >= cap then
    if ARGV[2] ~= 'drop_oldest' then
      redis.call('HINCRBY', KEYS[3], 'rejected:' .. ARGV[3], #ARGV - i + 1)
      break
    end
    local old = redis.call('LINDEX', KEYS[1], -1)
    redis.call('LPUSH', KEYS[2], dead_entry(old, 'drop_oldest', ARGV[3], ARGV[4], KEYS[1]))
    redis.call('RPOP', KEYS[1])
    evicted = evicted + 1
    n = n - 1
  end
  redis.call('LPUSH', KEYS[1], ARGV[i])
  n = n + 1
  accepted = accepted + 1
end
if evicted > 0 then redis.call('HINCRBY', KEYS[3], 'dropped:' .. ARGV[3], evicted) end
if accepted > 0 then mark_ready(KEYS[5], KEYS[1]) end
ring(KEYS[4], accepted)
return {accepted, n}
