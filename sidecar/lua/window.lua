-- Shared by every Sluice script (prepended first when the store loads them):
-- the window counter of sidecar/limiters/window.py, kind 'W', step for step,
-- Sluice's time, and KINDS. Numbers cross the Redis boundary as strings
-- printed with 17 significant digits, so every double survives the trip
-- exactly.
--
-- KINDS holds each kind of check under its code (sidecar.limiters.registry's
-- lua_kind), added by the kind's own file; evaluate.lua and inspect.lua call
-- these and name no kind. A check's arguments are its code and five values,
-- as its limiter's redis_args makes them.
--
-- KINDS[code] = {
--   limit(argv, at): the check's limit, read from its code argv[at] and
--     the five values after it (a new table: a call may write into it),
--   hit(key, limit, now, amount): over, retry after; `amount` requests
--     counted at once (a kind without assess),
--   assess(key, limit, now, amount, lease): over, retry after, delay,
--     charge; a deferred kind judges and writes nothing but a penalty, and
--     commit(key, limit, now, charge) charges the request once every check
--     admitted it (lease: the request's lease id, '' for none),
--   quota(key, limit, now): remaining, reset, window for the draft
--     RateLimit fields; changes nothing,
--   penalty(key, limit, now): seconds of the key's penalty left (0: none),
-- }
-- A key another kind wrote (a reloaded rule) counts as new for this one.
local KINDS = {}

local function num(x)
  return string.format('%.17g', x)
end

-- Seconds: the caller's clock (tests), or the Redis server's, which every
-- node and worker sharing this Redis shares.
local function clock(arg)
  if arg ~= '' then
    return tonumber(arg)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Python's float floor division (CPython float_floor_div), so that a window
-- index is the same number the memory store computes.
local function floordiv(a, b)
  local mod = math.fmod(a, b)
  local div = (a - mod) / b
  if mod ~= 0 and ((b < 0) ~= (mod < 0)) then
    div = div - 1.0
  end
  if div == 0 then
    return 0.0
  end
  local floored = math.floor(div)
  if div - floored > 0.5 then
    floored = floored + 1.0
  end
  return floored
end

-- Milliseconds from now until `at`, at least 1: every key expires.
local function pexpire_at(key, now, at)
  redis.call('PEXPIRE', key, math.max(1, math.ceil((at - now) * 1000)))
end

-- Is the key in its penalty? Returns (over, retry_after).
local function peek(key, now)
  local u = redis.pcall('HGET', key, 'u')
  local until_ = type(u) == 'string' and tonumber(u) or -math.huge
  if now < until_ then
    return true, until_ - now
  end
  return false, 0
end

-- The key's window state: (foreign, window, previous, current, penalty
-- end). A bucket's state under the key (the rule was reloaded as a window),
-- or a concurrency limit's sorted set, reads as a fresh one, as the memory
-- store treats a state of another kind.
local function read_window(key)
  local state = redis.pcall('HMGET', key, 'w', 'p', 'c', 'u', 'k')
  if state.err or state[5] then
    return true, -2, 0, 0, -math.huge
  end
  return false, tonumber(state[1]) or -2, tonumber(state[2]) or 0, tonumber(state[3]) or 0,
    tonumber(state[4]) or -math.huge
end

-- Seconds until `amount` would fit (WindowCounter._fits_in): this window's
-- count weighs in whole until the window ends, then fades over the next one.
local function fits_in(limit, elapsed, previous, current, amount)
  local threshold, period, sliding = limit[1], limit[2], limit[4]
  if not sliding or amount > threshold then
    return period - elapsed
  end
  local room = threshold - amount - current
  if room >= 0 and previous ~= 0 then
    return math.max(0, period - room * period / previous - elapsed)
  end
  room = threshold - amount
  local next_window = 0
  if current ~= 0 then next_window = period - room * period / current end
  return period - elapsed + next_window
end

-- hit of a fitting counter (WindowCounter._fit), once the key's window is
-- the current one: counted only when the request fits whole.
local function fit(key, now, limit, amount, moved, window, previous, current, until_)
  local threshold, period, penalty, sliding = limit[1], limit[2], limit[3], limit[4]
  local elapsed = now - window * period
  local faded = 0
  if sliding then faded = previous * (period - elapsed) / period end
  if current + amount + faded > threshold then
    if penalty > 0 then
      until_ = now + penalty
      redis.call('HSET', key, 'w', window, 'p', previous, 'c', current, 'u', until_)
      pexpire_at(key, now, math.max((window + (sliding and 2 or 1)) * period, until_))
      return true, penalty
    end
    return true, fits_in(limit, elapsed, previous, current, amount)
  end
  current = current + amount
  if moved then
    redis.call('HSET', key, 'w', window, 'p', previous, 'c', current)
    pexpire_at(key, now, math.max((window + (sliding and 2 or 1)) * period, until_))
  else
    redis.call('HSET', key, 'c', current)
  end
  return false, 0
end

-- Count `amount` for the key: WindowCounter.hit. `limit` is the table
-- limit_from reads.
local function hit(key, limit, now, amount)
  local threshold, period, penalty, sliding, exceed = limit[1], limit[2], limit[3], limit[4], limit[5]
  local foreign, window, previous, current, until_ = read_window(key)
  if foreign then
    redis.call('DEL', key)
  end
  if now < until_ then
    return true, until_ - now
  end
  local index = floordiv(now, period)
  local moved = index ~= window
  if moved then
    if index == window + 1 then previous = current else previous = 0 end
    current = 0
    window = index
  end
  if limit[6] then
    return fit(key, now, limit, amount, moved, window, previous, current, until_)
  end
  current = current + amount
  local estimate = current
  if sliding and previous ~= 0 then
    local elapsed = now - window * period
    estimate = estimate + previous * (period - elapsed) / period
  end
  -- Compared as a real number, never rounded.
  local reached
  if exceed then reached = estimate > threshold else reached = estimate >= threshold end
  if reached then
    until_ = now + penalty
  end
  -- Only what changed is written: within one window, the count (and a
  -- penalty that starts). The expiry depends on the window and the
  -- penalty alone, so it is set only when one of them changes.
  -- Numbers go as they are: Redis writes a script's number with 17
  -- significant digits, so every double survives, as num() would make it.
  if moved then
    if until_ > -math.huge then
      redis.call('HSET', key, 'w', window, 'p', previous, 'c', current, 'u', until_)
    else
      redis.call('HSET', key, 'w', window, 'p', previous, 'c', current)
    end
  elseif reached then
    redis.call('HSET', key, 'c', current, 'u', until_)
  else
    redis.call('HSET', key, 'c', current)
  end
  if moved or reached then
    local horizon = (window + (sliding and 2 or 1)) * period
    pexpire_at(key, now, math.max(horizon, until_))
  end
  return false, 0
end

-- A window's limit from its arguments at argv[at]: 'W', threshold,
-- period, penalty, sliding (1/0), then when the threshold is crossed:
-- reached ('0'), exceeded ('1', a score budget) or when the request would
-- not fit ('2', a Rate Limit Service descriptor).
local function limit_from(argv, at)
  return {tonumber(argv[at + 1]), tonumber(argv[at + 2]), tonumber(argv[at + 3]),
          argv[at + 4] == '1', argv[at + 5] == '1', argv[at + 5] == '2'}
end

-- (remaining, reset, window) for the draft RateLimit fields:
-- WindowCounter.quota. Changes nothing.
local function window_quota(key, now, limit, threshold)
  local period, sliding = limit[2], limit[4]
  local _, window, previous, current, until_ = read_window(key)
  if now < until_ then
    return 0, until_ - now, period
  end
  local index = floordiv(now, period)
  local elapsed = now - index * period
  if index ~= window then
    if index == window + 1 then previous = current else previous = 0 end
    current = 0
  end
  local estimate = current
  if sliding then
    estimate = current + previous * (period - elapsed) / period
  end
  if limit[6] then  -- requests that still fit whole
    return math.max(0, math.floor(threshold - estimate)), period - elapsed, period
  end
  return math.max(0, math.ceil(threshold - estimate)), period - elapsed, period
end

KINDS.W = {
  limit = limit_from,
  hit = hit,
  quota = function(key, limit, now) return window_quota(key, now, limit, limit[1]) end,
  penalty = function(key, limit, now)
    local foreign, _, _, _, until_ = read_window(key)
    if not foreign and now < until_ then
      return until_ - now
    end
    return 0
  end,
}
