-- Lists with work: every script that pushes into a tier list, front lane or sub-queue adds the list to the
-- app's index (a set, ``<prefix>.ready``) in the same call, and the fetch script removes it when it finds
-- the list empty, so a fetch asks only lists that have work (``fetch.lua``). '' or nil (a caller before the
-- index) = none.
-- A list that joins (was not in it) bumps ``<index>.version``: workers keep a copy of the index and pass the
-- fetch script only the lists in it, refreshing the copy when a fetch reply shows the version moved.
local function mark_ready(index, list)
  if index and index ~= '' and redis.call('SADD', index, list) == 1 then redis.call('INCR', index .. '.version') end
end
