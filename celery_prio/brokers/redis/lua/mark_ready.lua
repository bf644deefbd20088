-- Lists with work: every script that pushes into a tier list, front lane or sub-queue adds the list to the
-- app's index (a sorted set, ``<prefix>.ready-index``) in the same call, and the fetch script takes it out when it
-- finds the list empty, so a fetch asks only lists that have work (``fetch.lua``). '' or nil (a caller before
-- the index) = none. A member's score says what is known of its list: 0, pushed to since a fetch last found it
-- empty (asked); a time, found empty then and pushed nothing since (a sub-queue's list lingering: not asked,
-- it costs a fetch nothing, ``leave_index``).
-- A sub-queue's list that joins (was not in it) bumps ``<index>.version``: workers keep a copy of the index
-- and pass the fetch script only the sub-queue lists in it, refreshing the copy when a fetch reply shows the
-- version moved. A tier list or front lane joining does not: every worker passes those (six lists, whatever
-- its copy holds: ``ReadyCopy.select``), so work landing in an emptied tier does not make every worker read
-- the index again. Names: ``<prefix>.<tier>`` and ``<prefix>.<tier>${PROMOTED_SUFFIX}``; a sub-queue (a tenant's,
-- a task's shortest-job-first list) is ``<prefix>.<tier>.<name>`` (a name has no '.'). kombu's lists of a
-- message priority (``<list>\6\22<n>``, unused unless callers set priorities) are not pinned either. A name
-- not read as pinned bumps: always safe, only dearer. ``transport.pinned_list`` reads names the same way.
local function pinned_list(index, list)
  if string.find(list, '\6', 1, true) then return false end
  local rest = string.sub(list, #index - #'${READY_INDEX}' + 1)  -- after '<prefix>.'
  local dot = string.find(rest, '.', 1, true)
  return dot == nil or string.sub(rest, dot) == '${PROMOTED_SUFFIX}'
end

local function mark_ready(index, list)
  -- ZADD sets the score to 0 whether or not the list was in (a lingering list with work is asked again), and
  -- answers 1 only when it joins
  if index and index ~= '' and redis.call('ZADD', index, 0, list) == 1 and not pinned_list(index, list) then
    redis.call('INCR', index .. '.version')
  end
end

-- A list a fetch found empty leaves the index. A sub-queue's list lingers first for ``READY_LINGER`` seconds,
-- its score the time it was found empty: its joining again would move the version, and every worker serving
-- it then reads the index again (a realtime task's shortest-first list under a trickle of 20 calls a second
-- emptied and joined 20 times a second, each a stale round on every worker). While it lingers and nothing is
-- pushed to it, fetches pass it over for free (its score tells them it is empty); a push sets its score back
-- to 0 (``mark_ready``), and its linger starts again at the next empty look. ``since``: its score (nil: not
-- in the index). ``now`` is the caller's clock, read before its call: a worker's fetch often runs just after
-- another's stamp and reads a time a few ms before it. Only a stamp a whole linger ahead (a clock that was
-- wrong) ends the linger early; a small lead did, and a trickled list left and joined the index twice a second,
-- each time sending every worker's copy to be read again.
local function leave_index(index, list, now, since)
  if pinned_list(index, list) then
    redis.call('ZREM', index, list)
    return
  end
  since = tonumber(since)
  if since == 0 then
    redis.call('ZADD', index, 'XX', now, list)
  elseif since and math.abs(tonumber(now) - since) >= ${READY_LINGER} then
    redis.call('ZREM', index, list)
  end
end
