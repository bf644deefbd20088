-- A worker says it is alive, and which tiers it serves (so that a queue nobody serves is seen):
-- ``HSET <prefix>.heartbeats <worker> <Redis time>`` and ``HSET <prefix>.serving <worker> <tiers>``.
-- KEYS: heartbeats hash, serving hash. ARGV: worker name, served tier labels (comma-separated).
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], t[1] .. '.' .. string.format('%06d', t[2]))
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
