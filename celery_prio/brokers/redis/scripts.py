"""Lua scripts that make capacity, fetching, aging and dead-lettering atomic on Redis.

Tier lists follow kombu: LPUSH adds on the left, consumers RPOP the oldest on
the right. A dead-letter entry is a JSON envelope around the untouched
original element (whatever it was), so that requeueing gives Celery back
exactly what it sent and a malformed element is kept as evidence.

A Redis script is not rolled back when a command fails half-way: every
script here writes the copy before it removes the original, so an error
can duplicate an entry into the dead list but never lose one.
"""

from __future__ import annotations

#: Bytes of messages one script call reads at most where it walks a list (requeue, boost scan, the
#: fetch's dead-lettering): a few ms of Redis, and little Lua memory, whatever the messages' size.
SCRIPT_BYTES = 4 * 1024 * 1024
#: Oldest elements one publish evicts at most under ``drop_oldest``: after a cap is lowered, the
#: excess goes over the following publishes (bounded each) instead of in one call.
EVICT_BUDGET = 1000

#: Shared by the scripts below: wrap one element for the dead-letter list.
DEAD_ENTRY = """
local function dead_entry(raw, reason, tier, now, queue)
  return cjson.encode({
    headers = {prio_dead_reason = reason, prio_dead_tier = tier,
               prio_dead_at = tonumber(now), prio_dead_queue = queue},
    message = raw})
end
"""

#: KEYS: tier list, dead list, stats hash.
#: ARGV: message, cap, policy, tier label, now (epoch s).
#: Returns {accepted (1/0), depth after (or depth seen when refused)}.
GUARDED_PUSH = (
    DEAD_ENTRY
    + """
local n = redis.call('LLEN', KEYS[1])
local cap = tonumber(ARGV[2])
if n < cap then
  redis.call('LPUSH', KEYS[1], ARGV[1])
  return {1, n + 1}
end
if ARGV[3] ~= 'drop_oldest' then
  redis.call('HINCRBY', KEYS[3], 'rejected:' .. ARGV[4], 1)
  return {0, n}
end
local evicted = 0
while n >= cap and evicted < """
    + str(EVICT_BUDGET)
    + """ do
  local old = redis.call('LINDEX', KEYS[1], -1)
  if not old then break end
  redis.call('LPUSH', KEYS[2], dead_entry(old, 'drop_oldest', ARGV[4], ARGV[5], KEYS[1]))
  redis.call('RPOP', KEYS[1])
  evicted = evicted + 1
  n = n - 1
end
redis.call('HINCRBY', KEYS[3], 'dropped:' .. ARGV[4], evicted)
redis.call('LPUSH', KEYS[1], ARGV[1])
return {1, n + 1}
"""
)

#: Move up to ARGV[1] dead entries (oldest first) back to the queues they came from.
#: Only this app's queues are destinations (its tier and promoted queues, and
#: the sub-queues of its tiers: shortest-first queues, tenants): an entry is
#: data, never a routing instruction. An entry that is malformed or names
#: another destination is skipped (rotated to the newest end, so nothing is
#: lost and the pass moves on); a full destination stops the pass.
#: One call looks at no more than ARGV[2] entries and about ``SCRIPT_BYTES``
#: bytes, so a long list is requeued in calls that let Redis serve others.
#: KEYS: dead list. ARGV: limit, most entries to look at, then pairs of (queue
#: name, cap) for every allowed destination; a name ending in '.' stands for
#: every sub-queue of a tier (``<prefix>.<tier>.<1-64 letters, digits, _ or
#: ->``, not promoted/dlx). Returns {moved, left, skipped, looked, full (1 when
#: a full destination stopped it)}.
DEAD_REQUEUE = (
    """
local caps, heads = {}, {}
for i = 3, #ARGV, 2 do
  if string.sub(ARGV[i], -1) == '.' then heads[ARGV[i]] = tonumber(ARGV[i + 1])
  else caps[ARGV[i]] = tonumber(ARGV[i + 1]) end
end
local function cap_of(queue)
  if caps[queue] ~= nil then return caps[queue] end
  for head, cap in pairs(heads) do
    local rest = string.sub(queue, #head + 1)
    if string.sub(queue, 1, #head) == head and #rest >= 1 and #rest <= 64 and string.find(rest, '^[%w][%w_%-]*$')
       and rest ~= 'promoted' and rest ~= 'dlx' then
      return cap
    end
  end
  return nil
end
local moved, skipped, looked, bytes, full = 0, 0, 0, 0, 0
local limit = tonumber(ARGV[1])
local budget = tonumber(ARGV[2])
while moved < limit and looked < budget and bytes < """
    + str(SCRIPT_BYTES)
    + """ do
  local raw = redis.call('LINDEX', KEYS[1], -1)
  if not raw then break end
  looked = looked + 1
  bytes = bytes + #raw
  local ok, entry = pcall(cjson.decode, raw)
  local queue, message = nil, nil
  if ok and type(entry) == 'table' and type(entry['headers']) == 'table' then
    queue, message = entry['headers']['prio_dead_queue'], entry['message']
  end
  local cap = type(queue) == 'string' and cap_of(queue) or nil
  if type(message) ~= 'string' or cap == nil
     or (redis.call('TYPE', queue)['ok'] ~= 'list' and redis.call('TYPE', queue)['ok'] ~= 'none') then
    redis.call('LMOVE', KEYS[1], KEYS[1], 'RIGHT', 'LEFT')
    skipped = skipped + 1
  else
    if cap >= 0 and redis.call('LLEN', queue) >= cap then full = 1; looked = looked - 1; break end
    redis.call('LPUSH', queue, message)
    redis.call('RPOP', KEYS[1])
    moved = moved + 1
  end
end
return {moved, redis.call('LLEN', KEYS[1]), skipped, looked, full}
"""
)

#: Keep the dead-letter list under its cap (``prio_dead_letter_max``): drop
#: the oldest beyond it, at most ARGV[2] per call, and count them.
#: KEYS: dead list, stats hash. ARGV: cap, most to drop. Returns how many went.
TRIM_DEAD = """
local n = redis.call('LLEN', KEYS[1])
local cap = tonumber(ARGV[1])
if n <= cap then return 0 end
local drop = math.min(n - cap, tonumber(ARGV[2]))
redis.call('LTRIM', KEYS[1], 0, n - drop - 1)
redis.call('HINCRBY', KEYS[2], 'dead_dropped:all', drop)
return drop
"""

#: Move aged messages from the oldest end of a lower tier list to the upper
#: tier's promoted list, each only if it is still where the ager saw it (so
#: two agers never move one message twice) and while the upper tier has room.
#: The promoted list is FIFO like a tier list (LPUSH in, RPOP out), so
#: promoted messages are served oldest first across passes.
#: KEYS: source list, promoted list, upper tier list, stats hash.
#: ARGV: destination cap (-1 = none), source tier label, n, n originals
#: (oldest first), n rewritten copies. Returns the number moved.
PROMOTE = """
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
return moved
"""

#: Compare-and-set several list elements (stamping messages nobody stamped,
#: or whose stamp is unusable). KEYS: list. ARGV: triples of (index,
#: expected, replacement). Returns how many were set.
STAMP = """
local set = 0
for i = 1, #ARGV, 3 do
  local index = tonumber(ARGV[i])
  if redis.call('LINDEX', KEYS[1], index) == ARGV[i + 1] then
    redis.call('LSET', KEYS[1], index, ARGV[i + 2])
    set = set + 1
  end
end
return set
"""

#: Move the oldest elements of a list to the dead list, each only if it is
#: still the oldest (aging found them unusable). KEYS: list, dead list, stats
#: hash. ARGV: tier label, now, then pairs of (expected element, reason).
#: Returns how many moved.
DEAD_HEAD = (
    DEAD_ENTRY
    + """
local moved = 0
for i = 3, #ARGV, 2 do
  if redis.call('LINDEX', KEYS[1], -1) ~= ARGV[i] then break end
  redis.call('LPUSH', KEYS[2], dead_entry(ARGV[i], ARGV[i + 1], ARGV[1], ARGV[2], KEYS[1]))
  redis.call('RPOP', KEYS[1])
  moved = moved + 1
end
if moved > 0 then redis.call('HINCRBY', KEYS[3], 'dead_lettered:' .. ARGV[1], moved) end
return moved
"""
)

#: Dead-letter a message a worker fetched but cannot run, and forget it as
#: unacked and owned, atomically. KEYS: dead list, unacked hash, unacked
#: index, stats hash, owners hash. ARGV: raw element, reason, tier label, now,
#: source queue, delivery tag ('' if none).
DEAD_LETTER = (
    DEAD_ENTRY
    + """
redis.call('LPUSH', KEYS[1], dead_entry(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]))
if ARGV[6] ~= '' then
  redis.call('HDEL', KEYS[2], ARGV[6])
  redis.call('ZREM', KEYS[3], ARGV[6])
  redis.call('HDEL', KEYS[5], ARGV[6])
end
redis.call('HINCRBY', KEYS[4], 'dead_lettered:' .. ARGV[3], 1)
return 1
"""
)

#: Most malformed elements one fetch call moves aside before it answers (and at most
#: ``SCRIPT_BYTES`` of them), so a list full of garbage never holds Redis for long.
FETCH_DEAD_BUDGET = 100

#: Take the oldest message of the first non-empty list and record it as
#: unacked, in one round trip and atomically (kombu does RPOP, then a second
#: call to record it: a crash in between loses the message). An element that
#: is not a kombu envelope is moved to the dead list with its reason instead.
#: The fetching worker is recorded as the message's owner (``<prefix>.owners``:
#: tag -> worker|tier|fetched at, Redis time), so that when the worker is gone
#: any live worker can return the message at once (``SWEEP_DEAD_OWNERS``).
#: Every reply also carries the sub-queue registry's version, so a worker learns
#: of a new sub-queue from the fetches it makes anyway (no polling of its own).
#: KEYS: the lists in preference order, then the unacked hash, its index,
#: the dead list, the stats hash, the owners hash and the registry's version key.
#: ARGV: now, then one tier label per list, then the worker's name.
#: Returns {position of the list (1-based), message, version, delivery tag}
#: (the tag as cjson read it: Python may fail to decode what cjson accepts),
#: {0, n dead-lettered, version} when it stopped at its dead-letter budget,
#: or {-1, '', version} when all are empty.
FETCH = (
    DEAD_ENTRY
    + """
local n = #KEYS - 6
local version = redis.call('GET', KEYS[n + 6]) or ''
local dead, dead_bytes = 0, 0
for i = 1, n do
  while true do
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
      redis.call('LPUSH', KEYS[n + 3], dead_entry(raw, reason, ARGV[1 + i], ARGV[1], KEYS[i]))
      redis.call('RPOP', KEYS[i])
      redis.call('HINCRBY', KEYS[n + 4], 'dead_lettered:' .. ARGV[1 + i], 1)
      dead = dead + 1
      dead_bytes = dead_bytes + #raw
      if dead >= """
    + str(FETCH_DEAD_BUDGET)
    + """ or dead_bytes >= """
    + str(SCRIPT_BYTES)
    + """ then return {0, dead, version} end
    else
      local tag = msg['properties']['delivery_tag']
      -- A restore (the worker died) returns it to the list it came from, not
      -- to whatever its own delivery_info names: that is data, not an address.
      redis.call('ZADD', KEYS[n + 2], ARGV[1], tag)
      redis.call('HSET', KEYS[n + 1], tag, '[' .. raw .. ',"",' .. cjson.encode(KEYS[i]) .. ']')
      local t = redis.call('TIME')
      local fetched = t[1] .. '.' .. string.format('%06d', t[2])
      redis.call('HSET', KEYS[n + 5], tag, ARGV[n + 2] .. '|' .. ARGV[1 + i] .. '|' .. fetched)
      redis.call('RPOP', KEYS[i])
      return {i, raw, version, tag}
    end
  end
end
if dead > 0 then return {0, dead, version} end
return {-1, '', version}
"""
)

#: Publish many messages to one tier list in one call, under its cap.
#: ``reject``: push while the list is below the cap, stop at the first that
#: does not fit (the caller reports how many went in). ``drop_oldest``: push
#: all, evicting the oldest to the dead letters as needed.
#: KEYS: tier list, dead list, stats hash.
#: ARGV: cap (-1 = none), policy, tier label, now, then the messages.
#: Returns {accepted, depth after}.
BULK_PUSH = (
    DEAD_ENTRY
    + """
local cap = tonumber(ARGV[1])
local n = redis.call('LLEN', KEYS[1])
local count = #ARGV - 4
if cap < 0 or n + count <= cap then  -- room for all: one LPUSH
  redis.call('LPUSH', KEYS[1], unpack(ARGV, 5))
  return {count, n + count}
end
local accepted, evicted = 0, 0
for i = 5, #ARGV do
  if cap >= 0 and n >= cap then
    if ARGV[2] ~= 'drop_oldest' then
      redis.call('HINCRBY', KEYS[3], 'rejected:' .. ARGV[3], #ARGV - i + 1)
      break
    end
    local old = redis.call('LINDEX', KEYS[1], -1)
    redis.call('LPUSH', KEYS[2], dead_entry(old, 'drop_oldest', ARGV[3], ARGV[4], KEYS[1]))
    redis.call('RPOP', KEYS[1])
    evicted = evicted + 1
    n = n - 1
  end
  redis.call('LPUSH', KEYS[1], ARGV[i])
  n = n + 1
  accepted = accepted + 1
end
if evicted > 0 then redis.call('HINCRBY', KEYS[3], 'dropped:' .. ARGV[3], evicted) end
return {accepted, n}
"""
)

#: Elements one boost look reads at most, so Redis is never held long: about
#: about 25 ms on this project's 2-core box (a boost looks again until done).
BOOST_SCAN_BUDGET = 10_000

#: Find the task with id ARGV[1] in the lists KEYS, newest end first (a task
#: someone waits on was usually published lately), reading at most ARGV[2]
#: elements (and about ``SCRIPT_BYTES``) from list ARGV[3] (1-based), offset ARGV[4] on. Read-only. A
#: substring test finds candidates; the id is confirmed in the parsed headers
#: (a child's message carries its parent's id as ``parent_id``).
#: Returns {list, offset, element} when found, {0, list, offset} where the
#: budget ended (look again from there), or nil when it is in none of them.
BOOST_FIND = (
    """
local id = ARGV[1]
local budget = tonumber(ARGV[2])
local offset = tonumber(ARGV[4])
local bytes = """
    + str(SCRIPT_BYTES)
    + """
local chunk = 8  -- a first look of a few: the elements may be big; later looks are sized by weight
for i = tonumber(ARGV[3]), #KEYS do
  while true do
    if budget <= 0 or bytes <= 0 then return {0, i, offset} end
    local n = math.min(chunk, budget)
    local elems = redis.call('LRANGE', KEYS[i], offset, offset + n - 1)
    if #elems == 0 then break end
    local read = 0
    for j = 1, #elems do
      read = read + #elems[j]
      if string.find(elems[j], id, 1, true) then
        local ok, msg = pcall(cjson.decode, elems[j])
        if ok and type(msg) == 'table' and type(msg['headers']) == 'table' and msg['headers']['id'] == id then
          return {i, offset + j - 1, elems[j]}
        end
      end
    end
    budget = budget - #elems
    bytes = bytes - read
    offset = offset + #elems
    if #elems < n then break end
    -- next chunk sized by what these elements weigh: big messages are read a few at a time
    chunk = math.max(1, math.min(1000, math.floor(bytes / math.max(1, read / #elems))))
  end
  offset = 0
end
return nil
"""
)

#: Lift one element: remove it from its list and add its rewritten copy to
#: the destination, only if it is still there (a worker may have taken it,
#: aging moved it, another boost lifted it). Lossless: nothing is removed
#: unless the destination is a list the copy can go to.
#: KEYS: source list, destination list, stats hash. ARGV: element as found,
#: rewritten element, source tier label. Returns 1 if moved, 0 if it was gone.
BOOST_MOVE = """
local kind = redis.call('TYPE', KEYS[2])['ok']
if kind ~= 'list' and kind ~= 'none' then return redis.error_reply('boost destination is not a list') end
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[2])
redis.call('HINCRBY', KEYS[3], 'boosted:' .. ARGV[3], 1)
return 1
"""

#: Is the task with id ARGV[1] held by a worker (fetched, not acked: running
#: with acks_late, reserved, or waiting for its ETA)? KEYS: kombu's unacked
#: hash. Returns 1 or 0. Reads every in-flight entry: as many as the
#: fleet's slots and ETA tasks, not the backlog.
BOOST_HELD = """
local id = ARGV[1]
for _, raw in ipairs(redis.call('HVALS', KEYS[1])) do
  if string.find(raw, id, 1, true) then
    local ok, entry = pcall(cjson.decode, raw)
    -- kombu's entry: [message, exchange, routing key]
    local msg = ok and type(entry) == 'table' and entry[1]
    if type(msg) == 'table' and type(msg['headers']) == 'table' and msg['headers']['id'] == id then
      return 1
    end
  end
end
return 0
"""

#: A worker says it is alive, and which tiers it serves (so that a queue nobody serves is seen):
#: ``HSET <prefix>.heartbeats <worker> <Redis time>`` and ``HSET <prefix>.serving <worker> <tiers>``.
#: KEYS: heartbeats hash, serving hash. ARGV: worker name, served tier labels (comma-separated).
HEARTBEAT = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], t[1] .. '.' .. string.format('%06d', t[2]))
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

#: The messages of workers that are gone: owned by a worker whose last
#: heartbeat (or, with none, whose fetch) is older than the message's tier
#: allows. Each one found is taken over by the caller (its owner rewritten
#: to ``sweeper:<ARGV[1]>``) so that two sweepers never return one message
#: twice; the caller then restores it through kombu (which forgets the
#: owner). One taken but not restored within 10 s is taken again. Only this app's owners hash is
#: read: other apps' unacked messages are never touched.
#: One sweeper at a time for the whole fleet: the worker holding the lock
#: (KEYS[3], ~0.9 s) sweeps, the others return at once. Incremental: each
#: call reads one bounded chunk of the owners hash (HSCAN from the fleet's
#: cursor, KEYS[4]), so Redis serves others between chunks however many
#: messages are in flight; the caller calls again until the cursor wraps.
#: KEYS: owners hash, heartbeats hash, sweep lock, sweep cursor. ARGV: the
#: sweeping worker, the most entries to read, then pairs of (tier label,
#: seconds). Returns {cursor after this chunk ('0': a pass ended), tags
#: taken...}, or {} when another worker holds the lock.
SWEEP_DEAD_OWNERS = """
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
"""
