-- On a Redis Cluster, the ban a check in another slot called for (see
-- evaluate.lua, mode 'N'), issued in the address's slot.
-- KEYS: 1 the address's ban record, 2 the address's challenge counter.
-- ARGV: now ('' = server time), address, node, wall clock, auto-ban
--       {'W', threshold, period, penalty, sliding, exceed, duration}, rule
--       id, ban duration ('' = one more challenge: past the auto-ban
--       threshold, a ban of the auto-ban's duration instead; 'D F M R':
--       an escalating ban, see ban_history.lua).
-- Returns {new ban (1/0), rule, node, started, remaining, duration, step}.

local now = clock(ARGV[1])
local address, node, wall = ARGV[2], ARGV[3], ARGV[4]
local rule_id, ban_duration = ARGV[12], ARGV[13]
if ban_duration == '' then
  if not hit(KEYS[2], limit_from(ARGV, 5), now, 1) then
    return {0, '', '', '', '', '', 0}
  end
  ban_duration = ARGV[11]
  redis.call('DEL', KEYS[2])
end
local ban, step = write_rule_ban(KEYS[1], nil, now, address, rule_id, node, wall, ban_duration)
return {1, ban[1], ban[2], ban[3], ban[4], ban[5], step}
