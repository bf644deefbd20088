-- Ring a tier's doorbell: push up to n tokens onto the bell list (KEYS given by the caller), keeping
-- at most ${BELL_MAX}. Idle workers block on their tiers' bells (BLPOP) instead of polling the
-- queues; one token wakes one of them, and a burst wakes at most ${BELL_MAX}, which then fetch
-- until the queues are empty. A bell of '' rings nothing (a caller without a doorbell).
local function ring(bell, n)
  if bell == nil or bell == '' or n <= 0 then return end
  local tokens = {}
  for i = 1, math.min(n, ${BELL_MAX}) do tokens[i] = '1' end
  redis.call('LPUSH', bell, unpack(tokens))
  redis.call('LTRIM', bell, 0, ${BELL_MAX} - 1)
end
