-- The concurrency limit of sidecar/limiters/concurrent.py, kind 'C', step
-- for step. A key is a sorted set of the lease ids of the requests in
-- flight, scored by the time their lease ends; it expires with its last
-- lease. Arguments {'C', limit, lease (seconds), the request's lease id}
-- (in RULES, '': evaluate.lua passes the request's to assess).
-- A key of another kind (a reloaded rule) holds no slot and is replaced.

local function slots_from(argv, at)
  return {tonumber(argv[at + 1]), tonumber(argv[at + 2]), argv[at + 3]}
end

-- Judge: (over, retry after the shortest remaining lease). Like the
-- memory store's, the ended leases are dropped only when the key is full
-- (until then, a response reported after its lease ended still gives its
-- slot back), and a refusal changes nothing but leases that had ended.
local function slots_assess(key, slots, now)
  local held = redis.pcall('ZCARD', key)
  if type(held) ~= 'number' then
    redis.call('DEL', key)
    return false, 0
  end
  if held < slots[1] then
    return false, 0
  end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', num(now))
  if redis.call('ZCARD', key) < slots[1] then
    return false, 0
  end
  local shortest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  return true, tonumber(shortest[2]) - now
end

-- The admitted request's slot: its lease id until its lease ends; the key
-- lives as long as its longest lease.
local function slots_commit(key, slots, now)
  redis.call('ZADD', key, num(now + slots[2]), slots[3])
  local longest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  pexpire_at(key, now, tonumber(longest[2]))
end

-- (free slots, time until the shortest live lease ends (0 with none), the
-- lease) for the draft RateLimit fields. Changes nothing.
local function slots_quota(key, slots, now)
  local after = '(' .. num(now)
  local live = redis.pcall('ZCOUNT', key, after, '+inf')
  if type(live) ~= 'number' or live == 0 then
    return slots[1], 0, slots[2]
  end
  local shortest = redis.call('ZRANGEBYSCORE', key, after, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  return math.max(0, slots[1] - live), tonumber(shortest[2]) - now, slots[2]
end

-- Deferred: the slot is taken only when every check admitted the request.
-- No penalty: a concurrency limit refuses while it is full.
KINDS.C = {
  limit = slots_from,
  assess = function(key, slots, now, amount, lease)
    slots[3] = lease
    local over, retry = slots_assess(key, slots, now)
    return over, retry, 0, nil
  end,
  commit = function(key, slots, now) slots_commit(key, slots, now) end,
  quota = slots_quota,
  penalty = function() return 0 end,
}
