-- The bans in force, on a single Redis. KEYS: 1 the ban index.
-- ARGV: now ('' = server time), then what a ban record's name has before
-- and after the address.
-- Returns per ban: address, rule, node, started, remaining, duration, step,
-- reason ('' for a ban a rule issued).

return append_bans({}, KEYS[1], ARGV[2], ARGV[3], clock(ARGV[1]))
