-- Lift one element: remove it from its list and add its rewritten copy to
-- the destination, only if it is still there (a worker may have taken it,
-- aging moved it, another boost lifted it). Lossless: nothing is removed
-- unless the destination is a list the copy can go to.
-- The destination tier's doorbell rings.
-- KEYS: source list, destination list, stats hash, the destination tier's bell. ARGV: element as found,
-- rewritten element, source tier label. Returns 1 if moved, 0 if it was gone.
--#include ring
local kind = redis.call('TYPE', KEYS[2])['ok']
if kind ~= 'list' and kind ~= 'none' then return redis.error_reply('boost destination is not a list') end
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[2])
redis.call('HINCRBY', KEYS[3], 'boosted:' .. ARGV[3], 1)
ring(KEYS[4], 1)
return 1
