-- Publish one message to a tier list (or sub-queue) under its cap and its wait budget, and ring the tier's
-- doorbell.
-- KEYS: tier list, dead list, stats hash, the tier's bell, the admission hash (live slots per tier), the
-- sub-queue registry (a set of list names), the run-time estimates (list name -> seconds per task), the
-- index of lists with work ('' = none: see fetch.lua).
-- ARGV: message, cap (-1 = none), policy, tier label, now (epoch s), the tier's wait budget in seconds (-1 =
-- none), the tier's queue, its front lane ('' = none), its sub-queue name prefix ("<prefix>.<tier>.").
-- Returns {accepted (1/0), depth after (or depth seen when refused)}, and, when refused for its predicted
-- wait, that wait in seconds (a string: Lua numbers reach the caller as integers).
--#include dead_entry
--#include ring
--#include mark_ready

local n = redis.call('LLEN', KEYS[1])
local budget = tonumber(ARGV[6]) or -1  -- a caller that passes no budget: admitted by the cap alone
if budget >= 0 then
  -- The wait a new call would see: the work waiting in its tier (each list's messages times the fleet's
  -- estimate of their run time) over the live slots serving the tier. Unknown slots or estimates admit:
  -- a fleet learns from its first runs.
  local slots = tonumber(redis.call('HGET', KEYS[5], 'slots:' .. ARGV[4]))
  if slots and slots > 0 then
    local work = 0
    local function add(name)
      local waiting = redis.call('LLEN', name)
      if waiting > 0 then
        local each = tonumber(redis.call('HGET', KEYS[7], name))
        if each and each > 0 then work = work + waiting * each end
      end
    end
    add(ARGV[7])
    if ARGV[8] ~= '' then add(ARGV[8]) end
    local head = ARGV[9]
    for _, name in ipairs(redis.call('SMEMBERS', KEYS[6])) do
      if string.sub(name, 1, #head) == head and name ~= ARGV[8] then add(name) end
    end
    local wait = work / slots
    if wait > budget then
      redis.call('HINCRBY', KEYS[3], 'refused_wait:' .. ARGV[4], 1)
      return {0, n, string.format('%.6f', wait)}
    end
  end
end
local cap = tonumber(ARGV[2])
if cap < 0 or n < cap then
  redis.call('LPUSH', KEYS[1], ARGV[1])
  mark_ready(KEYS[8], KEYS[1])
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
mark_ready(KEYS[8], KEYS[1])
ring(KEYS[4], 1)
return {1, n + 1}
