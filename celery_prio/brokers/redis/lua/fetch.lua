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
-- Lists with work are indexed (``<prefix>.ready-index``, a sorted set: every publish
-- script adds the list it pushes to, ``mark_ready.lua``): a list marked '1' in
-- the mask is asked only if it is in the index with score 0 (one ZMSCORE for
-- all of them, not a look per list, so a busy worker's fetch costs the same
-- whether it serves 3 lists or 2,000; a lingering list, found empty and pushed
-- nothing since, is passed over), and leaves the index when this script finds
-- it empty. Lists marked '0' (queues other producers write to) are
-- always asked; lists marked '2' are asked whatever the index says and put
-- back into it when they hold work (a worker's full ask, at most once a
-- second when the index found nothing: the net for writers that do not
-- know the index).
-- KEYS: the lists in preference order, then the unacked hash, its index,
-- the dead list, the stats hash, the owners hash, the registry's version
-- key and the index of lists with work ('' = none), then the bells of the tiers asked.
-- ARGV: now, count, task name ('' = any), the worker's name, the mask (a '1' or '0' per list), the ready
-- version of the caller's copy of the index ('' = unchecked), then one tier label per list.
-- A caller whose copy is older than the index is told so ({-2, version, ready version, the index's members}:
-- its copy read again in the same round trip) before anything is
-- taken: a list that joined since (a shorter task's, a higher tier's) might otherwise be passed over.
-- Returns {position of the list (1-based), version, ready version, message, delivery tag, message, tag, ...}
-- (the tag as cjson read it: Python may fail to decode what cjson accepts),
-- {0, version, ready version, n dead-lettered} when it stopped at its dead-letter budget,
-- or {-1, version, ready version} when all are empty.
--#include dead_entry
--#include mark_ready

local n = #ARGV - 6
local count, task, worker, mask = tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local ready_key = KEYS[n + 7]
local version, ready_version
if ready_key ~= '' then  -- both versions in one command: a fetch is the busiest call there is
  local both = redis.call('MGET', KEYS[n + 6], ready_key .. '.version')
  -- '0' before any list ever joined: a copy read then is checked like any other ('' would mean unchecked)
  version, ready_version = both[1] or '', both[2] or '0'
else
  version, ready_version = redis.call('GET', KEYS[n + 6]) or '', ''
end
if ARGV[6] ~= '' and ARGV[6] ~= ready_version then
  return {-2, version, ready_version, redis.call('ZRANGE', ready_key, 0, -1)}  -- the copy, new, in the same reply
end
local indexed = {}  -- position -> its score in the index, false when not in it (lists the mask marks '1' or '2')
if ready_key ~= '' and string.find(mask, '[12]') then
  local asked = {}
  for i = 1, n do if string.find('12', string.sub(mask, i, i), 1, true) then asked[#asked + 1] = i end end
  for first = 1, #asked, 1000 do  -- unpack() takes a bounded number of values
    local names = {}
    for j = first, math.min(first + 999, #asked) do names[#names + 1] = KEYS[asked[j]] end
    local scores = redis.call('ZMSCORE', ready_key, unpack(names))
    for j = 1, #names do indexed[asked[first + j - 1]] = scores[j] and tonumber(scores[j]) end
  end
end
local present = {}  -- a full ask's lists ('2'): whether each holds anything, looked at once here
if ready_key ~= '' and string.find(mask, '2', 1, true) then
  for i = 1, n do  -- a full ask mends the index for every list it covers, not only the one it takes from
    if string.sub(mask, i, i) == '2' then
      present[i] = redis.call('EXISTS', KEYS[i]) == 1
      if present[i] and indexed[i] ~= 0 then
        if redis.call('ZADD', ready_key, 0, KEYS[i]) == 1 then
          ready_version = redis.call('INCR', ready_key .. '.version')
        end
        indexed[i] = 0
      end
    end
  end
end
local dead, dead_bytes = 0, 0
for i = 1, n do
  local label = ARGV[6 + i]
  local taken, taken_bytes = {i, version, ready_version}, 0
  local since = indexed[i]
  -- Asked: a list the index does not cover (nil), or one it holds with score 0 (pushed to since found empty);
  -- not a lingering one (a time: found empty, pushed nothing since) nor one out of it (false). A full ask's
  -- lists as EXISTS found them just above (no pop of an empty list).
  local look = since == nil or since == 0
  if present[i] ~= nil then look = present[i] end
  if look then
    while #taken < 3 + 2 * count do
      -- Popped first, one command where a look and a pop were two; a message this call does not take is
      -- pushed back to the same end, so the list is as it was (atomic: nothing runs between the two).
      local raw = redis.call('RPOP', KEYS[i])
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
        if #taken > 3 then  -- the batch so far goes first; the next fetch moves this aside
          redis.call('RPUSH', KEYS[i], raw)
          break
        end
        redis.call('LPUSH', KEYS[n + 3], dead_entry(raw, reason, label, ARGV[1], KEYS[i]))
        redis.call('HINCRBY', KEYS[n + 4], 'dead_lettered:' .. label, 1)
        dead = dead + 1
        dead_bytes = dead_bytes + #raw
        if dead >= ${FETCH_DEAD_BUDGET} or dead_bytes >= ${SCRIPT_BYTES} then return {0, version, ready_version, dead} end
      else
        if #taken > 3 and (taken_bytes + #raw > ${SCRIPT_BYTES}  -- one call copies a bounded amount
            or task ~= '' and (type(msg['headers']) ~= 'table' or msg['headers']['task'] ~= task)) then
          redis.call('RPUSH', KEYS[i], raw)  -- a batch holds one task's calls only
          break
        end
        taken_bytes = taken_bytes + #raw
        local tag = msg['properties']['delivery_tag']
        -- A restore (the worker died) returns it to the list it came from, not
        -- to whatever its own delivery_info names: that is data, not an address.
        redis.call('ZADD', KEYS[n + 2], ARGV[1], tag)
        redis.call('HSET', KEYS[n + 1], tag, '[' .. raw .. ',"",' .. cjson.encode(KEYS[i]) .. ']')
        local t = redis.call('TIME')
        local fetched = t[1] .. '.' .. string.format('%06d', t[2])
        redis.call('HSET', KEYS[n + 5], tag, worker .. '|' .. label .. '|' .. fetched)
        taken[#taken + 1] = raw
        taken[#taken + 1] = tag
      end
    end
  end
  -- Found empty: a tier list leaves the index, a sub-queue's starts its linger or, lingering, leaves once it is
  -- over (``leave_index``). One emptied by this take stays in it until a fetch finds it empty (one empty RPOP
  -- then, where checking after every take would cost a command per task on a busy list).
  if #taken == 3 and since then leave_index(ready_key, KEYS[i], ARGV[1], since) end
  if #taken > 3 then return taken end
end
if dead > 0 then return {0, version, ready_version, dead} end
for b = n + 8, #KEYS do redis.call('DEL', KEYS[b]) end
return {-1, version, ready_version}
