-- One request's decision: the ban check for the address, then
-- every check in rule order, as sidecar/policy.py's Policy.evaluate does,
-- in one step.
-- Deferred kinds (buckets, concurrency slots) are assessed in order and
-- charged at the end, only when the request is admitted by all of them and
-- no check refused it. Each kind is called through KINDS (see window.lua).
--
-- On a Redis Cluster a request's checks are split by hash slot, one call of
-- this script per slot (see sidecar/store/redis.py); the mode says what the
-- call does about bans:
--   'F' a single Redis: the ban check, and a ban written with its index entry;
--   'S' the slot of the address: the ban check, and a ban written without
--       the index (another slot);
--   'N' another slot: no ban check; a ban this call would issue is answered
--       as wanted (new ban 2, or 3 for one more challenge towards the
--       auto-ban) and the caller issues it in the address's slot.
--
-- KEYS: 1 the address's ban record, 2 the ban index, 3 the address's
--       challenge counter (auto-ban), 4.. one per check. In modes 'S' and 'N'
--       the keys a mode does not use repeat one of the call's own keys.
-- ARGV: now ('' = server time), address ('' = unknown), node, wall clock,
--       auto-ban {'W', threshold, period, penalty, sliding, exceed, duration},
--       can delay (1/0: a bucket may hold the request), quotas (1/0), mode,
--       the request's lease id ('' = none: it takes no concurrency slot),
--       then per check its number in RULES, followed by '*' and the
--       requests it counts at once when that is not 1 ('3*5', '3*0': a look).
-- RULES, written into the script by sidecar/store/redis.py, holds what a
-- check does, once for all requests: rule id, count (1/0), stops (1/0), ban
-- duration ('' = none; 'D F M R' for a ban that escalates, see
-- ban_history.lua), auto-ban (1/0), then the limiter's arguments: its
-- kind's code in KINDS and five values (6 to 11; a window's {threshold,
-- period, penalty, sliding, exceed}); then, for a challenge rule with
-- then_ban_after, its penalty counter {'W', threshold, period, penalty,
-- sliding, exceed} and the ban's duration (12 to 18).
-- Returns {banned, new ban, rule, node, started, remaining, duration,
--          delay, number of evaluated checks, then per evaluated check:
--          over (1/0), retry after; then with quotas, per check:
--          remaining, reset, window ('' for a check that does not count);
--          last, the step of the ban ('0' for none)}.

local now = clock(ARGV[1])
local address, node, wall = ARGV[2], ARGV[3], ARGV[4]
local auto_limit = limit_from(ARGV, 5)
local auto_duration = ARGV[11]
local can_delay, want_quotas = ARGV[12] == '1', ARGV[13] == '1'
local mode = ARGV[14]
local lease_id = ARGV[15]
local FIRST = 16

if address ~= '' and mode ~= 'N' then
  local ban = redis.call('HMGET', KEYS[1], 'rule', 'node', 'started', 'expires', 'duration', 'step')
  if ban[1] and now < tonumber(ban[4]) then
    return {1, 0, ban[1], ban[2], ban[3], num(tonumber(ban[4]) - now), ban[5], '0', 0, ban[6] or '0'}
  end
end

-- A check's entry in RULES and the requests it counts.
local function check_of(spec)
  local number = tonumber(spec)
  if number then
    return RULES[number], 1
  end
  local star = string.find(spec, '*', 1, true)
  return RULES[tonumber(string.sub(spec, 1, star - 1))], tonumber(string.sub(spec, star + 1))
end

local hits = {}
local deferred = {}
local refused = false
local result = {0, 0, '', '', '', '', ''}
local ban_step = 0
local checks = #ARGV - FIRST + 1
for i = 0, checks - 1 do
  local rule, amount = check_of(ARGV[FIRST + i])
  local key = KEYS[4 + i]
  local rule_id, count, stops, ban_duration = rule[1], rule[2], rule[3], rule[4]
  local over, retry
  if count ~= '1' then
    over, retry = peek(key, now)
  else
    local kind = KINDS[rule[6]]
    local limit = kind.limit(rule, 6)
    if kind.assess then
      local delay, charge
      over, retry, delay, charge = kind.assess(key, limit, now, amount, lease_id)
      if delay > 0 and not can_delay then
        -- The wait queue is full: a refusal, and nothing charged.
        over, retry = true, delay
      end
      table.insert(deferred, {kind, key, limit, over, delay, charge})
    else
      over, retry = kind.hit(key, limit, now, amount)
    end
  end
  table.insert(hits, over and 1 or 0)
  table.insert(hits, retry == 0 and '0' or num(retry))
  if over and stops == '1' then
    refused = true
    local ban_key = key
    if rule[5] == '1' and address ~= '' then
      if mode == 'N' then
        -- The challenge counter lives in the address's slot.
        result[2], result[3] = 3, rule_id
        break
      end
      -- One more challenge for this address: past the auto-ban threshold,
      -- a ban instead.
      ban_key = KEYS[3]
      if hit(ban_key, auto_limit, now, 1) then
        ban_duration = auto_duration
      end
    end
    if rule[12] == 'W' and ban_duration == '' and address ~= '' and mode ~= 'N' then
      -- then_ban_after (the rule's key holds the address: never mode 'N').
      local penalties = unsolved_penalty(KEYS[1], rule_id, now, retry, limit_from(rule, 12))
      if penalties then
        ban_key, ban_duration = penalties, rule[18]
      end
    end
    if ban_duration ~= '' and address ~= '' then
      -- Issuing a ban clears the triggering key.
      redis.call('DEL', ban_key)
      if mode == 'N' then
        result[2], result[3], result[7] = 2, rule_id, ban_duration
      else
        local ban
        ban, ban_step = write_rule_ban(KEYS[1], mode == 'F' and KEYS[2] or nil, now, address, rule_id,
                                       node, wall, ban_duration)
        result[2], result[3], result[4], result[5], result[6], result[7] = 1, unpack(ban)
      end
    end
    break
  end
end

-- Like nginx with several limit_req zones: buckets (and concurrency slots)
-- are charged only when the request is admitted by all of them.
-- One over its limit that did not refuse (observe mode) is not charged
-- itself.
local delay = 0
if not refused then
  for _, d in ipairs(deferred) do
    if not d[4] then
      d[1].commit(d[2], d[3], now, d[6])
      delay = math.max(delay, d[5])
    end
  end
end
table.insert(result, num(delay))
table.insert(result, #hits / 2)
for _, value in ipairs(hits) do
  table.insert(result, value)
end

if want_quotas then
  for i = 0, checks - 1 do
    local rule = check_of(ARGV[FIRST + i])
    local remaining, reset, window = '', '', ''
    if rule[2] == '1' then
      local kind = KINDS[rule[6]]
      remaining, reset, window = kind.quota(KEYS[4 + i], kind.limit(rule, 6), now)
      remaining, reset, window = num(remaining), num(reset), num(window)
    end
    table.insert(result, remaining)
    table.insert(result, reset)
    table.insert(result, window)
  end
end
table.insert(result, ban_step)
return result
