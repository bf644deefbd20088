-- Move the oldest elements of a list to the dead list, each only if it is
-- still the oldest (aging found them unusable). KEYS: list, dead list, stats
-- hash. ARGV: tier label, now, then pairs of (expected element, reason).
-- Returns how many moved.
--#include dead_entry

local moved = 0
for i = 3, #ARGV, 2 do
  if redis.call('LINDEX', KEYS[1], -1) ~= ARGV[i] then break end
  redis.call('LPUSH', KEYS[2], dead_entry(ARGV[i], ARGV[i + 1], ARGV[1], ARGV[2], KEYS[1]))
  redis.call('RPOP', KEYS[1])
  moved = moved + 1
end
if moved > 0 then redis.call('HINCRBY', KEYS[3], 'dead_lettered:' .. ARGV[1], moved) end
return moved
