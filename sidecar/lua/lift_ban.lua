-- Lift one ban. KEYS: 1 the ban record, 2 its index, 3 (a network's) the
-- admin version. ARGV: address or network, then with KEYS[3] the new
-- version and how long it is kept (ms).
-- Returns 1 if there was a ban record.

redis.call('ZREM', KEYS[2], ARGV[1])
if KEYS[3] then
  redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
end
return redis.call('DEL', KEYS[1])
