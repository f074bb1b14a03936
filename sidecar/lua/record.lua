-- Responses counted by response-phase rules, in one step.
-- KEYS: one per count. ARGV: now ('' = server time), then per count:
-- amount, then the limiter's arguments: its kind's code in KINDS (see
-- window.lua) and five values; only kinds that count at once (hit) count
-- responses (the rules file allows count_on on no other).
-- Returns per count: over (1/0), retry after.

local now = clock(ARGV[1])
local result = {}
for i = 1, #KEYS do
  local at = 2 + (i - 1) * 7
  local kind = KINDS[ARGV[at + 1]]
  local over, retry = kind.hit(KEYS[i], kind.limit(ARGV, at + 1), now, tonumber(ARGV[at]))
  table.insert(result, over and 1 or 0)
  table.insert(result, num(retry))
end
return result
