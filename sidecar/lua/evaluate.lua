-- One request's decision (SPEC §9): the ban check for the address, then
-- every check in rule order, as MemoryStore.evaluate does, in one step.
--
-- KEYS: 1 the address's ban record, 2 the ban index (address -> expiry),
--       3 the address's challenge counter (auto-ban), 4.. one per check.
-- ARGV: now ('' = server time), address ('' = unknown), node, wall clock,
--       auto-ban {threshold, period, penalty, sliding, exceed, duration},
--       then per check: rule id, count (1/0), stops (1/0), ban duration
--       ('' = none), auto-ban (1/0), {threshold, period, penalty, sliding, exceed}.
-- Returns {banned, new ban, rule, node, started, remaining, duration,
--          then per evaluated check: over (1/0), retry after}.

local now = clock(ARGV[1])
local address, node, wall = ARGV[2], ARGV[3], ARGV[4]
local auto_limit = limit_from(ARGV, 5)
local auto_duration = ARGV[10]
local FIRST, WIDTH = 11, 10

if address ~= '' then
  local ban = redis.call('HMGET', KEYS[1], 'rule', 'node', 'started', 'expires', 'duration')
  if ban[1] and now < tonumber(ban[4]) then
    return {1, 0, ban[1], ban[2], ban[3], num(tonumber(ban[4]) - now), ban[5]}
  end
end

local result = {0, 0, '', '', '', '', ''}
local checks = (#ARGV - FIRST + 1) / WIDTH
for i = 0, checks - 1 do
  local at = FIRST + i * WIDTH
  local key = KEYS[4 + i]
  local rule_id, count, stops, ban_duration = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3]
  local over, retry
  if count == '1' then
    over, retry = hit(key, now, limit_from(ARGV, at + 5), 1)
  else
    over, retry = peek(key, now)
  end
  table.insert(result, over and 1 or 0)
  table.insert(result, num(retry))
  if over and stops == '1' then
    local ban_key = key
    if ARGV[at + 4] == '1' and address ~= '' then
      -- One more challenge for this address: past the auto-ban threshold,
      -- a ban instead.
      ban_key = KEYS[3]
      if hit(ban_key, now, auto_limit, 1) then
        ban_duration = auto_duration
      end
    end
    if ban_duration ~= '' and address ~= '' then
      -- Issuing a ban clears the triggering key (SPEC §6).
      local duration = tonumber(ban_duration)
      local expires = now + duration
      redis.call('DEL', ban_key)
      redis.call('HSET', KEYS[1], 'rule', rule_id, 'node', node, 'started', wall,
                 'expires', num(expires), 'duration', ban_duration)
      pexpire_at(KEYS[1], now, expires)
      redis.call('ZADD', KEYS[2], num(expires), address)
      local index_end = tonumber(redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')[2])
      pexpire_at(KEYS[2], now, index_end)
      result[1], result[2], result[3], result[4] = 0, 1, rule_id, node
      result[5], result[6], result[7] = wall, num(duration), ban_duration
    end
    break
  end
end
return result
