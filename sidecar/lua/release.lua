-- The concurrency slots one request took (concurrent.lua), given back when
-- its response is reported, in one step.
-- KEYS: one per slot, the sorted set of its key. ARGV: 1 the request's lease id.
-- Returns how many of them were still held. A key that is no sorted set
-- (a reload made the rule another kind) holds none.

local released = 0
for i = 1, #KEYS do
  local removed = redis.pcall('ZREM', KEYS[i], ARGV[1])
  if type(removed) == 'number' then
    released = released + removed
  end
end
return released
