-- The messages of workers that are gone: owned by a worker whose last
-- heartbeat (or, with none, whose fetch) is older than the message's tier
-- allows. Each one found is taken over by the caller (its owner rewritten
-- to ``sweeper:<ARGV[1]>``) so that two sweepers never return one message
-- twice; the caller then restores it through kombu (which forgets the
-- owner). One taken but not restored within 10 s is taken again. Only this app's owners hash is
-- read: other apps' unacked messages are never touched.
-- One sweeper at a time for the whole fleet: the worker holding the lock
-- (KEYS[3], ~0.9 s) sweeps, the others return at once. Incremental: each
-- call reads one bounded chunk of the owners hash (HSCAN from the fleet's
-- cursor, KEYS[4]), so Redis serves others between chunks however many
-- messages are in flight; the caller calls again until the cursor wraps.
-- KEYS: owners hash, heartbeats hash, sweep lock, sweep cursor. ARGV: the
-- sweeping worker, the most entries to read, then pairs of (tier label,
-- seconds). Returns {cursor after this chunk ('0': a pass ended), tags
-- taken...}, or {} when another worker holds the lock.
-- No message in flight anywhere in the fleet (an idle one): nothing to sweep, and no lock, clock or cursor to
-- touch (they were 6 of an idle one-worker fleet's 46 commands a second).
if redis.call('EXISTS', KEYS[1]) == 0 then return {'0'} end
local holder = redis.call('GET', KEYS[3])
if holder and holder ~= ARGV[1] then return {} end
if not holder then redis.call('SET', KEYS[3], ARGV[1], 'PX', 900) end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limits = {}
for i = 3, #ARGV, 2 do limits[ARGV[i]] = tonumber(ARGV[i + 1]) end
local most = tonumber(ARGV[2])
local cursor = redis.call('GET', KEYS[4]) or '0'
local beats = {}
local taken = {}
local read = 0
repeat
  local page = redis.call('HSCAN', KEYS[1], cursor, 'COUNT', math.min(most - read, 500))
  cursor = page[1]
  local owners = page[2]
  read = read + #owners / 2
  for i = 1, #owners, 2 do
    local tag, owner = owners[i], owners[i + 1]
    local worker, tier, fetched = string.match(owner, '^(.*)|([^|]*)|([^|]*)$')
    local limit = limits[tier or ''] or limits['batch']
    local due = false
    if worker and limit then
      if string.sub(worker, 1, 8) == 'sweeper:' then
        due = now - (tonumber(fetched) or 0) > 10  -- taken by a sweeper that did not finish: take it again
      else
        if beats[worker] == nil then beats[worker] = tonumber(redis.call('HGET', KEYS[2], worker) or '') or false end
        due = now - (beats[worker] or tonumber(fetched) or 0) > limit
      end
    end
    if due then
      redis.call('HSET', KEYS[1], tag, 'sweeper:' .. ARGV[1] .. '|' .. tier .. '|' .. now)
      taken[#taken + 1] = tag
    end
  end
until cursor == '0' or read >= most
redis.call('SET', KEYS[4], cursor)
return {cursor, unpack(taken)}
