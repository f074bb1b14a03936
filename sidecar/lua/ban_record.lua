-- Shared by the scripts that issue a ban (prepended after the algorithms'
-- files): write the address's ban record, and on a single Redis its entry
-- in the ban index. On a Redis Cluster the index lives in another slot, so
-- the caller passes no index (nil) and bans are listed by scanning.
-- Returns the fields of the record as the scripts answer them.
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
