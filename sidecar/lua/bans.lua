-- The bans in force, on a single Redis. KEYS: 1 the ban index.
-- ARGV: now ('' = server time), then what a ban record's name has before
-- and after the address.
-- Returns per ban: address, rule, node, started, remaining, duration, step.

local now = clock(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', num(now))
local result = {}
for _, address in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local ban = redis.call('HMGET', ARGV[2] .. address .. ARGV[3], 'rule', 'node', 'started', 'expires',
                         'duration', 'step')
  if ban[1] and now < tonumber(ban[4]) then
    for _, value in ipairs({address, ban[1], ban[2], ban[3], num(tonumber(ban[4]) - now), ban[5],
                            ban[6] or '0'}) do
      table.insert(result, value)
    end
  end
end
return result
