-- Compare-and-set several list elements (stamping messages nobody stamped,
-- or whose stamp is unusable). KEYS: list. ARGV: triples of (index,
-- expected, replacement). Returns how many were set.
local set = 0
for i = 1, #ARGV, 3 do
  local index = tonumber(ARGV[i])
  if redis.call('LINDEX', KEYS[1], index) == ARGV[i + 1] then
    redis.call('LSET', KEYS[1], index, ARGV[i + 2])
    set = set + 1
  end
end
return set
