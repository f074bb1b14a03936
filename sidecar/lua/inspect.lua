-- Counting keys as their limiters describe them, for the admin API: read,
-- never counted (MemoryStore._describe, step for step).
-- KEYS: the keys. ARGV: now ('' = server time), then per key the
--       limiter's arguments as evaluate.lua's RULES holds them: its kind's
--       code in KINDS (see window.lua), or 'X' for no limiter (no rule
--       running now counts the key), and five values.
-- Returns per key: stored (1/0), penalty left (0 = none), then remaining,
--          reset and window as the draft RateLimit fields give them ('' for
--          kind 'X').

local now = clock(ARGV[1])
local result = {}
for i = 1, #KEYS do
  local key = KEYS[i]
  local at = 2 + (i - 1) * 6
  local kind = ARGV[at]
  local stored = redis.call('EXISTS', key)
  local penalty, remaining, reset, window = 0, '', '', ''
  if stored == 1 then
    if kind == 'X' then
      local _, retry = peek(key, now)
      penalty = retry
    else
      local algorithm = KINDS[kind]
      local limit = algorithm.limit(ARGV, at)
      penalty = algorithm.penalty(key, limit, now)
      remaining, reset, window = algorithm.quota(key, limit, now)
    end
  end
  table.insert(result, stored)
  table.insert(result, num(penalty))
  for _, value in ipairs({remaining, reset, window}) do
    table.insert(result, value == '' and '' or num(value))
  end
end
return result
