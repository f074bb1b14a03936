-- One request's decision (SPEC §9): the ban check for the address, then
-- every check in rule order, as MemoryStore.evaluate does, in one step.
-- Buckets and concurrency slots are assessed in order and charged at the
-- end, only when the request is admitted by all of them and no check
-- refused it.
--
-- KEYS: 1 the address's ban record, 2 the ban index (address -> expiry),
--       3 the address's challenge counter (auto-ban), 4.. one per check.
-- ARGV: now ('' = server time), address ('' = unknown), node, wall clock,
--       auto-ban {'W', threshold, period, penalty, sliding, exceed, duration},
--       can delay (1/0: a bucket may hold the request), quotas (1/0),
--       then per check: rule id, count (1/0), stops (1/0), ban duration
--       ('' = none), auto-ban (1/0), then the limiter's arguments: its kind
--       ('W' window, 'C' concurrency, else a bucket's, see buckets.lua) and
--       five values, for a window {threshold, period, penalty, sliding,
--       exceed}, for a bucket its four parameters and '', for a
--       concurrency limit {limit, lease, the request's lease id, '', ''}.
-- Returns {banned, new ban, rule, node, started, remaining, duration,
--          delay, number of evaluated checks, then per evaluated check:
--          over (1/0), retry after; then with quotas, per check:
--          remaining, reset, window ('' for a check that does not count)}.

local now = clock(ARGV[1])
local address, node, wall = ARGV[2], ARGV[3], ARGV[4]
local auto_limit = limit_from(ARGV, 6)
local auto_duration = ARGV[11]
local can_delay, want_quotas = ARGV[12] == '1', ARGV[13] == '1'
local FIRST, WIDTH = 14, 11

if address ~= '' then
  local ban = redis.call('HMGET', KEYS[1], 'rule', 'node', 'started', 'expires', 'duration')
  if ban[1] and now < tonumber(ban[4]) then
    return {1, 0, ban[1], ban[2], ban[3], num(tonumber(ban[4]) - now), ban[5], '0', 0}
  end
end

local hits = {}
local buckets = {}
local leases = {}
local refused = false
local result = {0, 0, '', '', '', '', ''}
local checks = (#ARGV - FIRST + 1) / WIDTH
for i = 0, checks - 1 do
  local at = FIRST + i * WIDTH
  local key = KEYS[4 + i]
  local rule_id, count, stops, ban_duration = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3]
  local over, retry
  if count ~= '1' then
    over, retry = peek(key, now)
  elseif ARGV[at + 5] == 'W' then
    over, retry = hit(key, now, limit_from(ARGV, at + 6), 1)
  elseif ARGV[at + 5] == 'C' then
    local slots = slots_from(ARGV, at + 5)
    over, retry = slots_assess(key, slots, now)
    table.insert(leases, {key, slots, over})
  else
    local bucket = bucket_from(ARGV, at + 5)
    local state = bucket_state(key, bucket)
    local delay, proposal
    over, retry, delay, proposal = bucket_assess(key, bucket, state, now)
    if delay > 0 and not can_delay then
      -- The wait queue is full: a refusal, and nothing charged.
      over, retry = true, delay
    end
    table.insert(buckets, {key, bucket, state, over, delay, proposal})
  end
  table.insert(hits, over and 1 or 0)
  table.insert(hits, num(retry))
  if over and stops == '1' then
    refused = true
    local ban_key = key
    if ARGV[at + 4] == '1' and address ~= '' then
      -- One more challenge for this address: past the auto-ban threshold,
      -- a ban instead.
      ban_key = KEYS[3]
      if hit(ban_key, now, auto_limit, 1) then
        ban_duration = auto_duration
      end
    end
    if ban_duration ~= '' and address ~= '' then
      -- Issuing a ban clears the triggering key (SPEC §6).
      local duration = tonumber(ban_duration)
      local expires = now + duration
      redis.call('DEL', ban_key)
      redis.call('HSET', KEYS[1], 'rule', rule_id, 'node', node, 'started', wall,
                 'expires', num(expires), 'duration', ban_duration)
      pexpire_at(KEYS[1], now, expires)
      redis.call('ZADD', KEYS[2], num(expires), address)
      local index_end = tonumber(redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')[2])
      pexpire_at(KEYS[2], now, index_end)
      result[1], result[2], result[3], result[4] = 0, 1, rule_id, node
      result[5], result[6], result[7] = wall, num(duration), ban_duration
    end
    break
  end
end

-- Like nginx with several limit_req zones: buckets (and concurrency slots)
-- are charged only when the request is admitted by all of them (SPEC §7).
-- One over its limit that did not refuse (observe mode) is not charged
-- itself.
local delay = 0
if not refused then
  for _, b in ipairs(buckets) do
    if not b[4] then
      bucket_commit(b[1], b[2], b[3], now, b[6])
      delay = math.max(delay, b[5])
    end
  end
  for _, l in ipairs(leases) do
    if not l[3] then
      slots_commit(l[1], l[2], now)
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
    local at = FIRST + i * WIDTH
    local remaining, reset, window = '', '', ''
    if ARGV[at + 1] == '1' then
      if ARGV[at + 5] == 'W' then
        remaining, reset, window = window_quota(KEYS[4 + i], now, limit_from(ARGV, at + 6),
                                                tonumber(ARGV[at + 6]))
      elseif ARGV[at + 5] == 'C' then
        remaining, reset, window = slots_quota(KEYS[4 + i], slots_from(ARGV, at + 5), now)
      else
        remaining, reset, window = bucket_quota(KEYS[4 + i], bucket_from(ARGV, at + 5), now)
      end
      remaining, reset, window = num(remaining), num(reset), num(window)
    end
    table.insert(result, remaining)
    table.insert(result, reset)
    table.insert(result, window)
  end
end
return result
