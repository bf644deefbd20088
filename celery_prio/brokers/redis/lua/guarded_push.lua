-- Publish one message to a tier list (or sub-queue) under its cap, and ring the tier's doorbell.
-- KEYS: tier list, dead list, stats hash, the tier's bell.
-- ARGV: message, cap (-1 = none), policy, tier label, now (epoch s).
-- Returns {accepted (1/0), depth after (or depth seen when refused)}.
--#include dead_entry
--#include ring

local n = redis.call('LLEN', KEYS[1])
local cap = tonumber(ARGV[2])
if cap < 0 or n < cap then
  redis.call('LPUSH', KEYS[1], ARGV[1])
  ring(KEYS[4], 1)
  return {1, n + 1}
end
if ARGV[3] ~= 'drop_oldest' then
  redis.call('HINCRBY', KEYS[3], 'rejected:' .. ARGV[4], 1)
  return {0, n}
end
local evicted = 0
while n >= cap and evicted < ${EVICT_BUDGET} do
  local old = redis.call('LINDEX', KEYS[1], -1)
  if not old then break end
  redis.call('LPUSH', KEYS[2], dead_entry(old, 'drop_oldest', ARGV[4], ARGV[5], KEYS[1]))
  redis.call('RPOP', KEYS[1])
  evicted = evicted + 1
  n = n - 1
end
redis.call('HINCRBY', KEYS[3], 'dropped:' .. ARGV[4], evicted)
redis.call('LPUSH', KEYS[1], ARGV[1])
ring(KEYS[4], 1)
return {1, n + 1}
