-- What each node copies from the admin slot, asked about every second:
-- the admin version, which every action an administrator takes changes,
-- and when it changed (or the caller asks with '*') the network bans.
-- KEYS: 1 the admin version, 2 the networks' index.
-- ARGV: now ('' = server time), the version the caller knows ('*' = read
--       the bans whatever it is), what a network's record name has before
--       the network.
-- Returns {version ('' = none), read (1/0), then when read, per network
--          ban: network, rule, node, started, remaining, duration, step, reason}.

local now = clock(ARGV[1])
local version = redis.call('GET', KEYS[1]) or ''
if version == ARGV[2] then
  return {version, 0}
end
return append_bans({version, 1}, KEYS[2], ARGV[3], '', now)
