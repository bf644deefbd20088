-- Lists with work: every script that pushes into a tier list, front lane or sub-queue adds the list to the
-- app's index (a set, ``<prefix>.ready``) in the same call, and the fetch script removes it when it finds
-- the list empty, so a fetch asks only lists that have work (``fetch.lua``). '' or nil (a caller before the
-- index) = none.
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
  local rest = string.sub(list, #index - 4)  -- after '<prefix>.'
  local dot = string.find(rest, '.', 1, true)
  return dot == nil or string.sub(rest, dot) == '${PROMOTED_SUFFIX}'
end

local function mark_ready(index, list)
  if index and index ~= '' and redis.call('SADD', index, list) == 1 and not pinned_list(index, list) then
    redis.call('INCR', index .. '.version')
  end
end

-- A list a fetch found empty leaves the index. A sub-queue's list lingers first (``<index>.empty``: list ->
-- when a fetch first found it empty) for ``READY_LINGER`` seconds: its joining again moves the version, and
-- every worker serving it then reads the index again (a realtime task's shortest-first list under a trickle
-- of 20 calls a second emptied and joined 20 times a second, each a stale round on every worker). Asked
-- while it lingers, it costs a fetch one empty look. ``since`` is not reset when work comes back: a list kept
-- busy is dropped at its first empty look after ``READY_LINGER``, which costs only a version move.
local function leave_index(index, list, now)
  if pinned_list(index, list) then
    redis.call('SREM', index, list)
    return
  end
  local since = redis.call('HGET', index .. '.empty', list)
  if not since then
    redis.call('HSET', index .. '.empty', list, now)
  elseif tonumber(now) - tonumber(since) >= ${READY_LINGER} or tonumber(now) < tonumber(since) then
    redis.call('SREM', index, list)
    redis.call('HDEL', index .. '.empty', list)
  end
end
