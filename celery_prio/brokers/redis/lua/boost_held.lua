-- Is the task with id ARGV[1] held by a worker (fetched, not acked: running
-- with acks_late, reserved, or waiting for its ETA)? KEYS: kombu's unacked
-- hash. ARGV: task id, HSCAN cursor, entries per look. Reads one page of the
-- hash: the caller goes on from the cursor returned, so no call blocks Redis
-- for longer than one page, however many messages the fleet holds.
-- Returns {1, '0'} when held, else {0, next cursor} ('0': the whole hash was read).
local id = ARGV[1]
local page = redis.call('HSCAN', KEYS[1], ARGV[2], 'COUNT', tonumber(ARGV[3]))
local entries = page[2]
for i = 2, #entries, 2 do
  local raw = entries[i]
  if string.find(raw, id, 1, true) then
    local ok, entry = pcall(cjson.decode, raw)
    -- kombu's entry: [message, exchange, routing key]
    local msg = ok and type(entry) == 'table' and entry[1]
    if type(msg) == 'table' and type(msg['headers']) == 'table' and msg['headers']['id'] == id then
      return {1, '0'}
    end
  end
end
return {0, page[1]}
