-- Is the task with id ARGV[1] held by a worker (fetched, not acked: running
-- with acks_late, reserved, or waiting for its ETA)? KEYS: kombu's unacked
-- hash. Returns 1 or 0. Reads every in-flight entry: as many as the
-- fleet's slots and ETA tasks, not the backlog.
local id = ARGV[1]
for _, raw in ipairs(redis.call('HVALS', KEYS[1])) do
  if string.find(raw, id, 1, true) then
    local ok, entry = pcall(cjson.decode, raw)
    -- kombu's entry: [message, exchange, routing key]
    local msg = ok and type(entry) == 'table' and entry[1]
    if type(msg) == 'table' and type(msg['headers']) == 'table' and msg['headers']['id'] == id then
      return 1
    end
  end
end
return 0
