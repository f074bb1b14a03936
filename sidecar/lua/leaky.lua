-- The leaky bucket of sidecar/limiters/leaky.py, kind 'L', step for step:
-- nginx's limit_req integer arithmetic. Parameters {'L', rate (requests per
-- second times 1000), burst and delay (thousandths of a request), penalty};
-- v is the excess in thousandths, l the last accounted time in whole ms.
--
-- Lua numbers are doubles: every value here is an integer well below 2^53,
-- so it is exact, and integer division is idiv (Python's //, corrected
-- against rounding).

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

BUCKETS.L = {
  fresh = function(bucket) return 0 end,

  -- The time the whole burst takes to drain.
  window = function(bucket) return (bucket[3] + 1000) / bucket[2] end,

  -- Like nginx, until drained and at least 60 s after the last request.
  expires = function(bucket, v, l)
    local drained = l + idiv(v * 1000, bucket[2])
    return math.max(drained, l + 60000) / 1000
  end,

  assess = function(bucket, v, l, now, amount)
    local rate, burst, delay = bucket[2], bucket[3], bucket[4]
    local now_ms = whole_ms(now)
    if l == nil and amount == 0 then
      return false, 0, nil  -- a look at a key never seen: nothing to write
    end
    local excess = 1000 * (amount - 1)
    if l ~= nil then
      excess = math.max(0, v - idiv(rate * math.max(0, now_ms - l), 1000) + 1000 * amount)
    end
    if excess > burst then
      -- _wait_ms: until `amount` requests fit within the burst again (a
      -- key never seen: from an empty bucket now).
      local needed = v + 1000 * amount - burst
      return true, math.max(0, (l or now_ms) - idiv(-needed * 1000, rate) - now_ms) / 1000
    end
    local delay_ms = 0
    if excess > delay then
      delay_ms = idiv((excess - delay) * 1000, rate)
    end
    return false, delay_ms / 1000, {excess, now_ms}
  end,

  quota = function(bucket, v, l, now)
    local rate, burst = bucket[2], bucket[3]
    local full_drain = (burst + 1000) / rate
    if l == nil then
      return idiv(burst, 1000) + 1, 0, full_drain
    end
    local drained = math.max(0, v - idiv(rate * math.max(0, whole_ms(now) - l), 1000))
    return math.max(0, idiv(burst - drained, 1000)), drained / rate, full_drain
  end,
}
KINDS.L = BUCKET_KIND
