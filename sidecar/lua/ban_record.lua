-- Shared by the scripts that issue or list bans (prepended after the
-- algorithms' files): write the address's ban record, and on a single
-- Redis its entry in the ban index. On a Redis Cluster the index lives in
-- another slot, so the caller passes no index (nil) and bans are listed by
-- scanning. Returns the fields of the record as the scripts answer them.
local function write_ban(record, index, now, address, rule_id, node, wall, ban_duration)
  local duration = tonumber(ban_duration)
  local expires = now + duration
  redis.call('HSET', record, 'rule', rule_id, 'node', node, 'started', wall,
             'expires', num(expires), 'duration', ban_duration)
  pexpire_at(record, now, expires)
  if index then
    redis.call('ZADD', index, num(expires), address)
    local index_end = tonumber(redis.call('ZRANGE', index, -1, -1, 'WITHSCORES')[2])
    pexpire_at(index, now, index_end)
  end
  return {rule_id, node, wall, num(duration), ban_duration}
end

-- The bans in force that an index names (the index of a single Redis, or
-- the networks' index), appended to `result`: per ban its name, rule,
-- node, started, remaining, duration, step (an escalating ban's, else 0),
-- reason ('' for a ban a rule issued).
-- A record is named head .. name .. tail; ended bans leave the index.
local function append_bans(result, index, head, tail, now)
  redis.call('ZREMRANGEBYSCORE', index, '-inf', num(now))
  for _, name in ipairs(redis.call('ZRANGE', index, 0, -1)) do
    local ban = redis.call('HMGET', head .. name .. tail, 'rule', 'node', 'started', 'expires', 'duration', 'step',
                           'reason')
    if ban[1] and now < tonumber(ban[4]) then
      for _, value in ipairs({name, ban[1], ban[2], ban[3], num(tonumber(ban[4]) - now), ban[5], ban[6] or '0',
                              ban[7] or ''}) do
        table.insert(result, value)
      end
    end
  end
  return result
end
