-- wrk script for the many-addresses flood (bench/bench_flood.py,
-- tests/integration/test_flood.py): every request names one of 1,000
-- client addresses in X-Forwarded-For, in turn, as a trusted proxy in front
-- of nginx would (the rules trust loopback, client_ip.trusted_proxies).
-- Each wrk thread starts at its own offset.
local ADDRESSES = 1000
local thread_count = 0

function setup(thread)
  thread:set("thread_id", thread_count)
  thread_count = thread_count + 1
end

local counter = 0

function init(args)
  counter = (thread_id or 0) * 499
end

function request()
  counter = counter + 1
  local n = counter % ADDRESSES
  local headers = {["X-Forwarded-For"] = string.format("10.9.%d.%d", math.floor(n / 256), n % 256)}
  return wrk.format("GET", "/flood", headers)
end
