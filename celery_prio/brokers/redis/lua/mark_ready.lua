-- Lists with work: every script that pushes into a tier list, front lane or sub-queue adds the list to the
-- app's index (a set, ``<prefix>.ready``) in the same call, and the fetch script removes it when it finds
-- the list empty, so a fetch asks only lists that have work (``fetch.lua``). '' or nil (a caller before the
-- index) = none.
local function mark_ready(index, list)
  if index and index ~= '' then redis.call('SADD', index, list) end
end
