-- Shared by every Sluice script (prepended after window.lua): the buckets of
-- sidecar/limiters.py, LeakyBucket and TokenBucket, step for step.
--
-- A bucket's hash: 'k' its kind ('L' leaky, 'T' token), 'v' the excess in
-- thousandths (leaky) or the tokens (token), 'l' the last accounted time
-- (whole ms, leaky; seconds, token), 'u' the end of its penalty. A key of
-- another kind (a reloaded rule) counts as new, as in the memory store.
--
-- Leaky arithmetic is nginx's integer arithmetic. Lua numbers are doubles:
-- every value here is an integer well below 2^53, so it is exact, and
-- integer division is idiv (Python's //, corrected against rounding).

-- Python's a // b for integers, b > 0.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

-- int(now * 1000 + 1e-6): whole milliseconds, truncated toward zero.
local function whole_ms(now)
  local ms = now * 1000 + 1e-6
  if ms >= 0 then return math.floor(ms) end
  return math.ceil(ms)
end

-- The bucket parameters of one check: kind, then
-- leaky {rate, burst, delay, penalty}, token {capacity, refill, cost, penalty}
-- (all in LeakyBucket's / TokenBucket's units; penalty nil = none).
local function bucket_from(argv, at)
  local penalty = argv[at + 4]
  return {argv[at], tonumber(argv[at + 1]), tonumber(argv[at + 2]), tonumber(argv[at + 3]),
          penalty ~= '' and tonumber(penalty) or nil}
end

-- The key's state: {v, l, u, fresh}; a new (or other-kind) key is fresh.
local function bucket_state(key, bucket)
  local s = redis.call('HMGET', key, 'k', 'v', 'l', 'u')
  if s[1] ~= bucket[1] then
    local v = 0
    if bucket[1] == 'T' then v = bucket[2] end
    return {v, nil, -math.huge, true}
  end
  return {tonumber(s[2]), tonumber(s[3]), tonumber(s[4]) or -math.huge, false}
end

-- expires_at: leaky, until drained and at least 60 s after the last
-- request (like nginx); token, until full again; and the penalty.
local function bucket_expires(bucket, v, l, u)
  if l == nil then return u end
  if bucket[1] == 'L' then
    local drained = l + idiv(v * 1000, bucket[2])
    return math.max(math.max(drained, l + 60000) / 1000, u)
  end
  return math.max(l + (bucket[2] - v) / bucket[3], u)
end

-- _refuse: nothing changes, unless the rule sets a penalty, which starts.
-- Returns (over, retry after, delay, proposal).
local function bucket_refuse(key, bucket, state, now, wait)
  local penalty = bucket[5]
  if penalty == nil then
    return true, wait, 0, nil
  end
  local until_ = now + penalty
  state[3] = until_
  redis.call('HSET', key, 'u', num(until_))
  pexpire_at(key, now, bucket_expires(bucket, state[1], state[2], until_))
  return true, penalty, 0, nil
end

-- assess: (over, retry after, delay in seconds, proposal {v, l}).
local function bucket_assess(key, bucket, state, now)
  local until_ = state[3]
  if now < until_ then
    return true, until_ - now, 0, nil
  end
  local v, l = state[1], state[2]
  if bucket[1] == 'L' then
    local rate, burst, delay = bucket[2], bucket[3], bucket[4]
    local now_ms = whole_ms(now)
    local excess = 0
    if l ~= nil then
      excess = math.max(0, v - idiv(rate * math.max(0, now_ms - l), 1000) + 1000)
    end
    if excess > burst then
      -- _wait_ms: until a request fits within the burst again.
      local needed = v + 1000 - burst
      local wait_ms = math.max(0, l - idiv(-needed * 1000, rate) - now_ms)
      return bucket_refuse(key, bucket, state, now, wait_ms / 1000)
    end
    local delay_ms = 0
    if excess > delay then
      delay_ms = idiv((excess - delay) * 1000, rate)
    end
    return false, 0, delay_ms / 1000, {excess, now_ms}
  end
  local capacity, refill, cost = bucket[2], bucket[3], bucket[4]
  local tokens = v
  if l ~= nil then
    tokens = math.min(capacity, v + refill * math.max(0, now - l))
  end
  if cost > tokens then
    return bucket_refuse(key, bucket, state, now, (cost - tokens) / refill)
  end
  return false, 0, 0, {tokens - cost, now}
end

-- commit: the admitted request's proposal becomes the key's state.
local function bucket_commit(key, bucket, state, now, proposal)
  if state[4] then
    redis.call('DEL', key)
  end
  local fields = {'k', bucket[1], 'v', num(proposal[1]), 'l', num(proposal[2])}
  if state[3] > -math.huge then
    table.insert(fields, 'u')
    table.insert(fields, num(state[3]))
  end
  redis.call('HSET', key, unpack(fields))
  pexpire_at(key, now, bucket_expires(bucket, proposal[1], proposal[2], state[3]))
end

-- quota: (remaining, reset, window) for the draft RateLimit fields.
local function bucket_quota(key, bucket, now)
  local state = bucket_state(key, bucket)
  local v, l, until_ = state[1], state[2], state[3]
  if bucket[1] == 'L' then
    local rate, burst = bucket[2], bucket[3]
    local full_drain = (burst + 1000) / rate
    if now < until_ then
      return 0, until_ - now, full_drain
    end
    if l == nil then
      return idiv(burst, 1000) + 1, 0, full_drain
    end
    local drained = math.max(0, v - idiv(rate * math.max(0, whole_ms(now) - l), 1000))
    return math.max(0, idiv(burst - drained, 1000)), drained / rate, full_drain
  end
  local capacity, refill, cost = bucket[2], bucket[3], bucket[4]
  if now < until_ then
    return 0, until_ - now, capacity / refill
  end
  local tokens = v
  if l ~= nil then
    tokens = math.min(capacity, v + refill * math.max(0, now - l))
  end
  return floordiv(tokens, cost), (capacity - tokens) / refill, capacity / refill
end
