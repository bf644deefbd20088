-- Lift one element: remove it from its list and add its rewritten copy to
-- the destination, only if it is still there (a worker may have taken it,
-- aging moved it, another boost lifted it) and the destination tier has room
-- under its cap (a boost is admitted like a publish: it does not jump a full
-- tier). Lossless: nothing is removed unless the copy can go to the destination.
-- The destination tier's doorbell rings.
-- KEYS: source list, destination list (the tier's front lane), stats hash, the destination tier's bell,
-- the destination tier's list, the sub-queue registry (a set of list names), the index of lists with work
-- ('' = none).
-- ARGV: element as found, rewritten element, source tier label, the destination tier's cap (-1: none),
-- the destination tier's sub-queue name prefix ("<prefix>.<tier>."). What counts against the cap: the tier's
-- list, its front lane and its registered sub-queues, read here, so a sub-queue made a moment ago counts.
-- Returns 1 if moved, 0 if it was gone, -1 if the destination tier is full (then nothing changed).
--#include ring
--#include mark_ready
local kind = redis.call('TYPE', KEYS[2])['ok']
if kind ~= 'list' and kind ~= 'none' then return redis.error_reply('boost destination is not a list') end
local cap = tonumber(ARGV[4])
if cap >= 0 then
  local waiting = redis.call('LLEN', KEYS[5]) + redis.call('LLEN', KEYS[2])
  local head = ARGV[5]
  for _, name in ipairs(redis.call('SMEMBERS', KEYS[6])) do
    if string.sub(name, 1, #head) == head and name ~= KEYS[2] then waiting = waiting + redis.call('LLEN', name) end
  end
  if waiting >= cap then return -1 end
end
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[2])
mark_ready(KEYS[7], KEYS[2])
redis.call('HINCRBY', KEYS[3], 'boosted:' .. ARGV[3], 1)
ring(KEYS[4], 1)
return 1
