-- The token bucket of sidecar/limiters/token.py, kind 'T', step for step.
-- Parameters {'T', capacity, refill (tokens per second), cost, penalty}; v
-- is the tokens, l the last accounted time in seconds.

local function tokens_at(bucket, v, l, now)
  if l == nil then return v end
  return math.min(bucket[2], v + bucket[3] * math.max(0, now - l))
end

BUCKETS.T = {
  -- A bucket starts full.
  fresh = function(bucket) return bucket[2] end,

  -- The time an empty bucket takes to fill.
  window = function(bucket) return bucket[2] / bucket[3] end,

  -- Until full again.
  expires = function(bucket, v, l) return l + (bucket[2] - v) / bucket[3] end,

  assess = function(bucket, v, l, now, amount)
    local refill, cost = bucket[3], bucket[4] * amount
    local tokens = tokens_at(bucket, v, l, now)
    if cost > tokens then
      return true, (cost - tokens) / refill
    end
    return false, 0, {tokens - cost, now}
  end,

  quota = function(bucket, v, l, now)
    local capacity, refill = bucket[2], bucket[3]
    local tokens = tokens_at(bucket, v, l, now)
    return floordiv(tokens, bucket[4]), (capacity - tokens) / refill, capacity / refill
  end,
}
KINDS.T = BUCKET_KIND
