-- A worker says it is alive, and which tiers it serves (so that a queue nobody serves is seen):
-- ``HSET <prefix>.heartbeats <worker> <Redis time>`` and ``HSET <prefix>.serving <worker> <tiers>``.
-- The same beat holds or takes the fleet's housekeeper lease: the fleet-wide jobs (returning gone
-- workers' messages, aging, pruning, the dead-letter cap) run on the one worker that holds it, and
-- when that worker dies its lease runs out and the next beat of another worker takes it over.
-- KEYS: heartbeats hash, serving hash, the housekeeper lease, slots hash. ARGV: worker name, served tier labels
-- (comma-separated), the lease's length in ms: 0 when this worker cannot run the fleet's jobs now (its event
-- loop is held by a task under the solo pool, or it is shutting down): it then gives the lease up, or does not
-- take it, so another worker's next beat takes it; the worker's concurrency (written with its tiers, for
-- admission by predicted wait). Returns 1 when this worker holds the lease, else 0.
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], t[1] .. '.' .. string.format('%06d', t[2]))
if ARGV[2] ~= '' then  -- '': unchanged since the last beat
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  redis.call('HSET', KEYS[4], ARGV[1], ARGV[4])
end
local holder = redis.call('GET', KEYS[3])
if ARGV[3] == '0' then
  if holder == ARGV[1] then redis.call('DEL', KEYS[3]) end
  return 0
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
  return 1
end
if not holder then
  redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[3])
  return 1
end
return 0
