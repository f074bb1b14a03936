-- A tier assigned to an identity by hand, or the assignment removed, in
-- the admin slot: with a new version of the assignments and a new admin
-- version, so that every node reads them again (admin_state.lua).
-- KEYS: 1 the tier assignments (a hash: identity -> tier), 2 their
--       version, 3 the admin version.
-- ARGV: identity, tier ('' = remove the identity's assignment), the new
--       version (of both), how long the admin version is kept (ms), the
--       most assignments the hash holds.
-- Returns 1 when assigned or removed, 0 when there was none to remove, -1
-- when a new identity would make more than the most (nothing written).

local identity, tier = ARGV[1], ARGV[2]
if tier == '' then
  if redis.call('HDEL', KEYS[1], identity) == 0 then
    return 0
  end
elseif redis.call('HEXISTS', KEYS[1], identity) == 0 and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[5]) then
  return -1
else
  redis.call('HSET', KEYS[1], identity, tier)
end
redis.call('SET', KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
return 1
