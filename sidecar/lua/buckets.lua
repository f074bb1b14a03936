-- Shared by every Sluice script (prepended after window.lua): what the
-- buckets of sidecar/limiters/ share (bucket.py), step for step. Each bucket
-- algorithm adds its own arithmetic to BUCKETS under its kind, and
-- BUCKET_KIND to KINDS, in its own file (leaky.lua, token.lua), loaded after
-- this one.
--
-- A bucket's hash: 'k' its kind, 'v' its value (the leaky bucket's excess,
-- the token bucket's tokens), 'l' the last accounted time, 'u' the end of
-- its penalty. A key of another kind (a reloaded rule) counts as new, as in
-- the memory store.
--
-- BUCKETS[kind] = {
--   fresh(bucket): v of a key never seen,
--   window(bucket): the window of the draft RateLimit fields,
--   expires(bucket, v, l): when a state last accounted at l stops mattering,
--   assess(bucket, v, l, now, amount): true, wait (refused) or false, delay, proposal {v, l}
--     (nil: nothing to write), for `amount` requests at once,
--   quota(bucket, v, l, now): remaining, reset, window outside a penalty,
-- }
local BUCKETS = {}

-- The bucket parameters of one check: kind, three parameters in the
-- bucket's own units (see its file), penalty (nil = none).
local function bucket_from(argv, at)
  local penalty = argv[at + 4]
  return {argv[at], tonumber(argv[at + 1]), tonumber(argv[at + 2]), tonumber(argv[at + 3]),
          penalty ~= '' and tonumber(penalty) or nil}
end

-- The key's state: {v, l, u, fresh, foreign}; a new (or other-kind) key is
-- fresh, and one of another kind (another bucket's, a window's with a
-- penalty, a concurrency limit's sorted set) is foreign: cleared before it
-- is written.
local function bucket_state(key, bucket)
  local s = redis.pcall('HMGET', key, 'k', 'v', 'l', 'u')
  if s.err then
    return {BUCKETS[bucket[1]].fresh(bucket), nil, -math.huge, true, true}
  end
  if s[1] ~= bucket[1] then
    return {BUCKETS[bucket[1]].fresh(bucket), nil, -math.huge, true, s[1] ~= false or s[4] ~= false}
  end
  return {tonumber(s[2]), tonumber(s[3]), tonumber(s[4]) or -math.huge, false}
end

-- expires_at: the algorithm's, and the penalty.
local function bucket_expires(bucket, v, l, u)
  if l == nil then return u end
  return math.max(BUCKETS[bucket[1]].expires(bucket, v, l), u)
end

-- refuse: nothing changes, unless the rule sets a penalty, which starts.
-- A key never seen (or of another kind) refused by its own bucket (a batch
-- beyond the burst) is kept for its penalty as this kind's, never
-- accounted, as the policy keeps its new state. Returns (over, retry
-- after, delay, proposal).
local function bucket_refuse(key, bucket, state, now, wait)
  local penalty = bucket[5]
  if penalty == nil then
    return true, wait, 0, nil
  end
  local until_ = now + penalty
  state[3] = until_
  if state[4] then
    if state[5] then
      redis.call('DEL', key)
    end
    redis.call('HSET', key, 'k', bucket[1], 'v', state[1], 'u', until_)
    state[4], state[5] = false, false
  else
    redis.call('HSET', key, 'u', until_)
  end
  pexpire_at(key, now, bucket_expires(bucket, state[1], state[2], until_))
  return true, penalty, 0, nil
end

-- assess `amount` requests at once: (over, retry after, delay in seconds,
-- proposal {v, l}).
local function bucket_assess(key, bucket, state, now, amount)
  local until_ = state[3]
  if now < until_ then
    return true, until_ - now, 0, nil
  end
  local over, wait_or_delay, proposal = BUCKETS[bucket[1]].assess(bucket, state[1], state[2], now, amount)
  if over then
    return bucket_refuse(key, bucket, state, now, wait_or_delay)
  end
  return false, 0, wait_or_delay, proposal
end

-- commit: the admitted request's proposal becomes the key's state.
local function bucket_commit(key, bucket, state, now, proposal)
  -- Numbers go as they are (17 significant digits, as num() would write
  -- them); a fresh key gets its kind, a key of another kind goes first.
  if proposal == nil then
    return
  end
  if state[5] then
    redis.call('DEL', key)
  end
  if state[4] then
    if state[3] > -math.huge then
      redis.call('HSET', key, 'k', bucket[1], 'v', proposal[1], 'l', proposal[2], 'u', state[3])
    else
      redis.call('HSET', key, 'k', bucket[1], 'v', proposal[1], 'l', proposal[2])
    end
  else
    redis.call('HSET', key, 'v', proposal[1], 'l', proposal[2])
  end
  pexpire_at(key, now, bucket_expires(bucket, proposal[1], proposal[2], state[3]))
end

-- quota: (remaining, reset, window) for the draft RateLimit fields.
local function bucket_quota(key, bucket, now)
  local state = bucket_state(key, bucket)
  local algorithm = BUCKETS[bucket[1]]
  if now < state[3] then
    return 0, state[3] - now, algorithm.window(bucket)
  end
  return algorithm.quota(bucket, state[1], state[2], now)
end

-- Every bucket's entry in KINDS (see window.lua): deferred, its state read
-- once and handed to commit.
local BUCKET_KIND = {
  limit = bucket_from,
  assess = function(key, bucket, now, amount)
    local state = bucket_state(key, bucket)
    local over, retry, delay, proposal = bucket_assess(key, bucket, state, now, amount)
    return over, retry, delay, {state, proposal}
  end,
  commit = function(key, bucket, now, charge)
    bucket_commit(key, bucket, charge[1], now, charge[2])
  end,
  quota = bucket_quota,
  penalty = function(key, bucket, now)
    local state = bucket_state(key, bucket)
    if now < state[3] then
      return state[3] - now
    end
    return 0
  end,
}
