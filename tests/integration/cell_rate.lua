-- The cell rate of tests/integration/cell_rate.py, kind 'G', step for
-- step. Arguments {'G', cells, period (seconds), '', '', ''}. A key is a
-- hash: 'k' 'G', 't' its theoretical arrival time; it expires at that time.
-- A key another kind wrote counts as new, and goes when this one writes.

-- The key's arrival time, now at the earliest, and whether the key is not
-- this kind's (new, or another kind's: cleared before it is written).
local function cell_tat(key, now)
  local state = redis.pcall('HMGET', key, 'k', 't')
  if state.err or state[1] ~= 'G' then
    return now, true
  end
  return math.max(tonumber(state[2]), now), false
end

KINDS.G = {
  limit = function(argv, at) return {tonumber(argv[at + 1]), tonumber(argv[at + 2])} end,

  hit = function(key, limit, now, amount)
    local cells, period = limit[1], limit[2]
    local start, foreign = cell_tat(key, now)
    local tat = start + period / cells * amount
    if tat - now > period then
      return true, tat - now - period
    end
    if foreign then
      redis.call('DEL', key)
    end
    redis.call('HSET', key, 'k', 'G', 't', tat)
    pexpire_at(key, now, tat)
    return false, 0
  end,

  quota = function(key, limit, now)
    local cells, period = limit[1], limit[2]
    local tat = cell_tat(key, now)
    return math.max(0, math.floor((now + period - tat) / (period / cells))), tat - now, period
  end,

  penalty = function() return 0 end,
}
