-- The ready index's safety net (run by the fleet's housekeeper): every list given that holds work joins the
-- index. A writer that does not know the index (a producer on a celery-prio release before it, a plain kombu
-- client pushing into a tier list) is seen here within the housekeeper's round instead of never.
-- It also takes out of the index the lists given that are empty (``leave_index``: a sub-queue's after its
-- linger). A fetch drops a list only when it asks it and finds it empty, and a busy fetch stops at its first
-- hit: an idle tenant ordered after a busy list (or an idle fleet's lists) would stay in the index for good,
-- and every list in it costs every fetch a key and a member test.
-- KEYS: the index, then the lists to look at. ARGV: now. Returns how many were missing from it.
--#include mark_ready
local missing = 0
local scores = {}  -- one read of the index (the lists with work: few), not a member test per empty list
local flat = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for j = 1, #flat, 2 do scores[flat[j]] = flat[j + 1] end
for i = 2, #KEYS do
  local score = scores[KEYS[i]]
  if redis.call('EXISTS', KEYS[i]) == 1 then
    if not score then
      if redis.call('ZADD', KEYS[1], 0, KEYS[i]) == 1 then missing = missing + 1 end
    elseif tonumber(score) ~= 0 then
      redis.call('ZADD', KEYS[1], 0, KEYS[i])  -- work in a lingering list, by a writer that does not ring it
    end
  elseif score then
    leave_index(KEYS[1], KEYS[i], ARGV[1], score)
  end
end
if missing > 0 then redis.call('INCR', KEYS[1] .. '.version') end
return missing
