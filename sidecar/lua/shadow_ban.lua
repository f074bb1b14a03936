-- A shadow rule's would-be ban: a note that refuses nobody, listed with
-- the bans. KEYS: 1 its record. ARGV: rule, node, started (wall clock),
-- duration (s), then how long it is kept (ms). The record and its expiry
-- are one step, so that a record never outlives its ban.

redis.call('HSET', KEYS[1], 'rule', ARGV[1], 'node', ARGV[2], 'started', ARGV[3], 'duration', ARGV[4])
return redis.call('PEXPIRE', KEYS[1], ARGV[5])
