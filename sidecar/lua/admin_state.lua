-- What each node copies from the admin slot, asked about every second:
-- the admin version, which every action an administrator takes changes,
-- and when it changed (or the caller asks with '*') the network bans and,
-- when their own version changed too, the tier assignments.
-- KEYS: 1 the admin version, 2 the networks' index, 3 the tier assignments
--       (a hash: identity -> tier), 4 their version.
-- ARGV: now ('' = server time), the version the caller knows ('*' = read
--       the bans whatever it is), what a network's record name has before
--       the network, the assignments' version the caller knows ('*' = read
--       them whatever it is).
-- Returns {version ('' = none), read (1/0), then when read: the
--          assignments' version ('' = none), the assignments (identity,
--          tier, ...) when that version is not the one known, else 0; then
--          per network ban: network, rule, node, started, remaining,
--          duration, step, reason}.

local now = clock(ARGV[1])
local version = redis.call('GET', KEYS[1]) or ''
if version == ARGV[2] then
  return {version, 0}
end
local tiers_version = redis.call('GET', KEYS[4]) or ''
local tiers = 0
if tiers_version ~= ARGV[4] then
  tiers = redis.call('HGETALL', KEYS[3])
end
return append_bans({version, 1, tiers_version, tiers}, KEYS[2], ARGV[3], '', now)
