-- Dead-letter a message a worker fetched but cannot run, and forget it as
-- unacked and owned, atomically. KEYS: dead list, unacked hash, unacked
-- index, stats hash, owners hash. ARGV: raw element, reason, tier label, now,
-- source queue, delivery tag ('' if none).
--#include dead_entry

redis.call('LPUSH', KEYS[1], dead_entry(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]))
if ARGV[6] ~= '' then
  redis.call('HDEL', KEYS[2], ARGV[6])
  redis.call('ZREM', KEYS[3], ARGV[6])
  redis.call('HDEL', KEYS[5], ARGV[6])
end
redis.call('HINCRBY', KEYS[4], 'dead_lettered:' .. ARGV[3], 1)
return 1
