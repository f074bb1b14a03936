-- Lift one address's ban. KEYS: 1 the ban record, 2 the ban index.
-- ARGV: address. Returns 1 if there was a ban record.

redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('DEL', KEYS[1])
