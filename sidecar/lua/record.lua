-- Responses counted by response-phase rules (SPEC §8), in one step.
-- KEYS: one per count. ARGV: now ('' = server time), then per count:
-- amount, {threshold, period, penalty, sliding, exceed}.
-- Returns per count: over (1/0), retry after.

local now = clock(ARGV[1])
local result = {}
for i = 1, #KEYS do
  local at = 2 + (i - 1) * 6
  local over, retry = hit(KEYS[i], now, limit_from(ARGV, at + 1), tonumber(ARGV[at]))
  table.insert(result, over and 1 or 0)
  table.insert(result, num(retry))
end
return result
