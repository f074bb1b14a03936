-- Shared by every Sluice script (prepended after ban_record.lua): what bans
-- remember of an address, beside its ban record. The keys are named after
-- the record ('sluice:{ADDRESS}:ban'), so they share its hash tag, and on
-- a Redis Cluster its slot, which the calling script runs in:
--   'sluice:{ADDRESS}:banstep:RULE'    the last escalating ban by the rule:
--       'n' its step, 'd' its length, 'e' when it is forgotten (remember
--       after it ends); expires then;
--   'sluice:{ADDRESS}:counted:RULE'    the end of the rule's last penalty
--       counted towards then_ban_after; expires then;
--   'sluice:{ADDRESS}:penalties:RULE'  those penalties, a window counter.

local function beside_ban(record, name, rule_id)
  return string.sub(record, 1, -4) .. name .. ':' .. rule_id
end

-- A rule's ban: 'D' is a ban of D seconds (step 0); 'D F M R' (see
-- BanIncrement.lua_spec) escalates: within R seconds after the end of the
-- address's last ban by the rule, F times that one, at least D, at most M.
-- Returns the length (as the record stores it) and the step.
local function escalated(record, rule_id, now, spec)
  local duration, factor, longest, remember = string.match(spec, '^(%S+) (%S+) (%S+) (%S+)$')
  if not duration then
    return spec, 0
  end
  local history = beside_ban(record, 'banstep', rule_id)
  local last = redis.call('HMGET', history, 'n', 'd', 'e')
  local step, length = 0, tonumber(duration)
  if last[1] and now < tonumber(last[3]) then
    step = tonumber(last[1]) + 1
    length = math.min(math.max(tonumber(last[2]) * tonumber(factor), length), tonumber(longest))
  end
  local forgotten = now + length + tonumber(remember)
  redis.call('HSET', history, 'n', step, 'd', num(length), 'e', num(forgotten))
  pexpire_at(history, now, forgotten)
  return num(length), step
end

-- write_ban for a ban of `spec` (a rule's, escalated as it says, or an
-- auto-ban's): the record also keeps the step. Returns write_ban's fields
-- and the step.
local function write_rule_ban(record, index, now, address, rule_id, node, wall, spec)
  local duration, step = escalated(record, rule_id, now, spec)
  local ban = write_ban(record, index, now, address, rule_id, node, wall, duration)
  redis.call('HSET', record, 'step', step)
  return ban, step
end

-- then_ban_after: count the penalty of the rule's key this challenged
-- request is in, once (a new penalty can only start after the last counted
-- one ended; `retry` is the seconds until this one does), by the window
-- counter `limit`. Returns the counter's key when the penalty is one past
-- its threshold (the caller bans, and clears it), else nil.
local function unsolved_penalty(record, rule_id, now, retry, limit)
  local counted = beside_ban(record, 'counted', rule_id)
  local ends = tonumber(redis.call('GET', counted))
  if ends and now < ends then
    return nil
  end
  ends = now + retry
  redis.call('SET', counted, num(ends))
  pexpire_at(counted, now, ends)
  local penalties = beside_ban(record, 'penalties', rule_id)
  if hit(penalties, limit, now, 1) then
    return penalties
  end
  return nil
end
