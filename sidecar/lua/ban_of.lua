-- One ban record, if in force (for listing the bans of a Redis Cluster,
-- and for showing one client's).
-- KEYS: 1 the ban record. ARGV: now ('' = server time).
-- Returns {rule, node, started, remaining, duration, step, reason}, or {}
-- when none; a ban issued by hand has the rule '' and a reason.

local now = clock(ARGV[1])
local ban = redis.call('HMGET', KEYS[1], 'rule', 'node', 'started', 'expires', 'duration', 'step', 'reason')
if ban[1] and now < tonumber(ban[4]) then
  return {ban[1], ban[2], ban[3], num(tonumber(ban[4]) - now), ban[5], ban[6] or '0', ban[7] or ''}
end
return {}
