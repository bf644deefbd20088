-- Keep the dead-letter list under its cap (``prio_dead_letter_max``): drop
-- the oldest beyond it, at most ARGV[2] per call, and count them.
-- KEYS: dead list, stats hash. ARGV: cap, most to drop. Returns how many went.
local n = redis.call('LLEN', KEYS[1])
local cap = tonumber(ARGV[1])
if n <= cap then return 0 end
local drop = math.min(n - cap, tonumber(ARGV[2]))
redis.call('LTRIM', KEYS[1], 0, n - drop - 1)
redis.call('HINCRBY', KEYS[2], 'dead_dropped:all', drop)
return drop
