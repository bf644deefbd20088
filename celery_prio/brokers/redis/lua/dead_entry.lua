-- Shared by the scripts below: wrap one element for the dead-letter list.
local function dead_entry(raw, reason, tier, now, queue)
  return cjson.encode({
    headers = {prio_dead_reason = reason, prio_dead_tier = tier,
               prio_dead_at = tonumber(now), prio_dead_queue = queue},
    message = raw})
end
