-- The ready index's safety net (run by the fleet's housekeeper): every list given that holds work joins the
-- index. A writer that does not know the index (a producer on a celery-prio release before it, a plain kombu
-- client pushing into a tier list) is seen here within the housekeeper's round instead of never.
-- KEYS: the index, then the lists to look at. Returns how many were missing from it.
local missing = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 and redis.call('SADD', KEYS[1], KEYS[i]) == 1 then missing = missing + 1 end
end
if missing > 0 then redis.call('INCR', KEYS[1] .. '.version') end
return missing
