-- Move up to ARGV[1] dead entries (oldest first) back to the queues they came from.
-- Only this app's queues are destinations (its tier and promoted queues, and
-- the sub-queues of its tiers: shortest-first queues, tenants): an entry is
-- data, never a routing instruction. An entry that is malformed or names
-- another destination is skipped (rotated to the newest end, so nothing is
-- lost and the pass moves on); a full destination stops the pass.
-- One call looks at no more than ARGV[2] entries and about ``SCRIPT_BYTES``
-- bytes, so a long list is requeued in calls that let Redis serve others.
-- KEYS: dead list, the index of lists with work ('' = none). ARGV: limit, most entries to look at, then pairs of (queue
-- name, cap) for every allowed destination; a name ending in '.' stands for
-- every sub-queue of a tier (``<prefix>.<tier>.<1-64 letters, digits, _ or
-- ->``, not promoted/dlx). Returns {moved, left, skipped, looked, full (1 when
-- a full destination stopped it)}.
--#include mark_ready
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
while moved < limit and looked < budget and bytes < ${SCRIPT_BYTES} do
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
    mark_ready(KEYS[2], queue)
    redis.call('RPOP', KEYS[1])
    moved = moved + 1
  end
end
return {moved, redis.call('LLEN', KEYS[1]), skipped, looked, full}
