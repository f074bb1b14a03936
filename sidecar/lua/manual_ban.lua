-- A ban issued by hand: of one client address (its ban record, and on a
-- single Redis its entry in the ban index), or of a network (its record and
-- its entry in the networks' index, in the admin slot). Replaces the ban
-- the record held.
-- KEYS: 1 the ban record, 2 its index, 3 the admin version (in modes that
--       use neither, the record again).
-- ARGV: now ('' = server time), address or network, node, wall clock,
--       duration, reason, index (1/0), the new admin version ('' = leave
--       it), how long the version is kept (ms).
-- Returns {rule, node, started, remaining, duration} as write_ban does.

local now = clock(ARGV[1])
local index = nil
if ARGV[7] == '1' then
  index = KEYS[2]
end
local ban = write_ban(KEYS[1], index, now, ARGV[2], '', ARGV[3], ARGV[4], ARGV[5])
-- A ban by hand is no step of a rule's escalation.
redis.call('HSET', KEYS[1], 'reason', ARGV[6], 'step', 0)
if ARGV[8] ~= '' then
  redis.call('SET', KEYS[3], ARGV[8], 'PX', ARGV[9])
end
return ban
