-- Take the oldest message of the first non-empty list and record it as
-- unacked, in one round trip and atomically (kombu does RPOP, then a second
-- call to record it: a crash in between loses the message). An element that
-- is not a kombu envelope is moved to the dead list with its reason instead.
-- The fetching worker is recorded as the message's owner (``<prefix>.owners``:
-- tag -> worker|tier|fetched at, Redis time), so that when the worker is gone
-- any live worker can return the message at once (``SWEEP_DEAD_OWNERS``).
-- Every reply also carries the sub-queue registry's version, so a worker learns
-- of a new sub-queue from the fetches it makes anyway (no polling of its own).
-- When every list is empty, the doorbells of the tiers asked are silenced: a
-- token left from work another worker took would only wake an idle worker
-- for nothing (a publish after this call rings again).
-- A batch (``count`` > 1) takes up to ``count`` messages of one list, oldest
-- first, each recorded the same way, and stops at one of another task (``task``)
-- or before ``SCRIPT_BYTES`` of them (the caller asks again for more).
-- KEYS: the lists in preference order, then the unacked hash, its index,
-- the dead list, the stats hash, the owners hash and the registry's version
-- key, then the bells of the tiers asked.
-- ARGV: now, count, task name ('' = any), the worker's name, then one tier label per list.
-- Returns {position of the list (1-based), version, message, delivery tag, message, tag, ...}
-- (the tag as cjson read it: Python may fail to decode what cjson accepts),
-- {0, version, n dead-lettered} when it stopped at its dead-letter budget,
-- or {-1, version} when all are empty.
--#include dead_entry

local n = #ARGV - 4
local count, task, worker = tonumber(ARGV[2]), ARGV[3], ARGV[4]
local version = redis.call('GET', KEYS[n + 6]) or ''
local dead, dead_bytes = 0, 0
for i = 1, n do
  local label = ARGV[4 + i]
  local taken, taken_bytes = {i, version}, 0
  while #taken < 2 + 2 * count do
    local raw = redis.call('LINDEX', KEYS[i], -1)
    if not raw then break end
    local ok, msg = pcall(cjson.decode, raw)
    local reason = nil
    if not ok then
      reason = 'malformed: not JSON'
    elseif type(msg) ~= 'table' then
      reason = 'malformed: envelope is not an object'
    elseif type(msg['properties']) ~= 'table' then
      reason = "malformed: envelope has no 'properties' object"
    elseif type(msg['properties']['delivery_tag']) ~= 'string' then
      reason = 'malformed: properties.delivery_tag missing or not a string'
    elseif msg['headers'] ~= nil and type(msg['headers']) ~= 'table' then
      reason = 'malformed: headers are not an object'
    end
    if reason then
      if #taken > 2 then break end  -- the batch so far goes first; the next fetch moves this aside
      redis.call('LPUSH', KEYS[n + 3], dead_entry(raw, reason, label, ARGV[1], KEYS[i]))
      redis.call('RPOP', KEYS[i])
      redis.call('HINCRBY', KEYS[n + 4], 'dead_lettered:' .. label, 1)
      dead = dead + 1
      dead_bytes = dead_bytes + #raw
      if dead >= ${FETCH_DEAD_BUDGET} or dead_bytes >= ${SCRIPT_BYTES} then return {0, version, dead} end
    else
      if task ~= '' and #taken > 2 and (type(msg['headers']) ~= 'table' or msg['headers']['task'] ~= task) then
        break  -- a batch holds one task's calls only
      end
      if #taken > 2 and taken_bytes + #raw > ${SCRIPT_BYTES} then break end  -- one call copies a bounded amount
      taken_bytes = taken_bytes + #raw
      local tag = msg['properties']['delivery_tag']
      -- A restore (the worker died) returns it to the list it came from, not
      -- to whatever its own delivery_info names: that is data, not an address.
      redis.call('ZADD', KEYS[n + 2], ARGV[1], tag)
      redis.call('HSET', KEYS[n + 1], tag, '[' .. raw .. ',"",' .. cjson.encode(KEYS[i]) .. ']')
      local t = redis.call('TIME')
      local fetched = t[1] .. '.' .. string.format('%06d', t[2])
      redis.call('HSET', KEYS[n + 5], tag, worker .. '|' .. label .. '|' .. fetched)
      redis.call('RPOP', KEYS[i])
      taken[#taken + 1] = raw
      taken[#taken + 1] = tag
    end
  end
  if #taken > 2 then return taken end
end
if dead > 0 then return {0, version, dead} end
for b = n + 7, #KEYS do redis.call('DEL', KEYS[b]) end
return {-1, version}
