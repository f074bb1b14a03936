-- Responses counted by response-phase rules, in one step.
-- KEYS: one per count. ARGV: now ('' = server time), then per count:
-- amount, then the limiter's arguments: 'W' and {threshold, period,
-- penalty, sliding, exceed}; only window counters count responses (the
-- rules file allows count_on and score budgets on no other).
-- Returns per count: over (1/0), retry after.

local now = clock(ARGV[1])
local result = {}
for i = 1, #KEYS do
  local at = 2 + (i - 1) * 7
  local over, retry = hit(KEYS[i], now, limit_from(ARGV, at + 2), tonumber(ARGV[at]))
  table.insert(result, over and 1 or 0)
  table.insert(result, num(retry))
end
return result
