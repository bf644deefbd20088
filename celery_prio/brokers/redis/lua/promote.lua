-- Move aged messages from the oldest end of a lower tier list to the upper
-- tier's promoted list, each only if it is still where the ager saw it (so
-- two agers never move one message twice) and while the upper tier has room.
-- The promoted list is FIFO like a tier list (LPUSH in, RPOP out), so
-- promoted messages are served oldest first across passes.
-- The upper tier's doorbell rings once per message moved.
-- KEYS: source list, promoted list, upper tier list, stats hash, the upper tier's bell, the index of lists
-- with work ('' = none).
-- ARGV: destination cap (-1 = none), source tier label, n, n originals
-- (oldest first), n rewritten copies. Returns the number moved.
--#include ring
--#include mark_ready
local cap = tonumber(ARGV[1])
local n = tonumber(ARGV[3])
local moved = 0
for i = 1, n do
  if redis.call('LINDEX', KEYS[1], -1) ~= ARGV[3 + i] then break end
  if cap >= 0 and redis.call('LLEN', KEYS[2]) + redis.call('LLEN', KEYS[3]) >= cap then break end
  redis.call('LPUSH', KEYS[2], ARGV[3 + n + i])
  redis.call('RPOP', KEYS[1])
  moved = moved + 1
end
if moved > 0 then redis.call('HINCRBY', KEYS[4], 'promoted:' .. ARGV[2], moved) end
if moved > 0 then mark_ready(KEYS[6], KEYS[2]) end
ring(KEYS[5], moved)
return moved
