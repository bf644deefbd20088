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
