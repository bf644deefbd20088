-- Find the task with id ARGV[1] in the lists KEYS, newest end first (a task
-- someone waits on was usually published lately), reading at most ARGV[2]
-- elements (and about ``SCRIPT_BYTES``) from list ARGV[3] (1-based), offset ARGV[4] on. Read-only. A
-- substring test finds candidates; the id is confirmed in the parsed headers
-- (a child's message carries its parent's id as ``parent_id``).
-- Returns {list, offset, element} when found, {0, list, offset} where the
-- budget ended (look again from there), or nil when it is in none of them.
local id = ARGV[1]
local budget = tonumber(ARGV[2])
local offset = tonumber(ARGV[4])
local bytes = ${SCRIPT_BYTES}
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
