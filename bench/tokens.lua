-- wrk script for bench/bench_identity.py: each request carries one of the
-- tokens of the file given (one per line) as a bearer token, from the
-- client address that goes with it in X-Forwarded-For (trusted from
-- loopback by the bench's rules), so that keyed on jwt:sub or on ip each
-- token's client is one key.
--
--   wrk -s bench/tokens.lua URL -- TOKENS_FILE
local tokens = {}
local counter = 0
local thread_count = 0

function setup(thread)
  thread:set("thread_id", thread_count)
  thread_count = thread_count + 1
end

function init(args)
  for line in io.lines(args[1]) do
    tokens[#tokens + 1] = line
  end
  counter = (thread_id or 0) * 499
end

function request()
  counter = counter + 1
  local n = counter % #tokens
  local headers = {
    ["X-Forwarded-For"] = string.format("10.0.%d.%d", math.floor(n / 256) % 256, n % 256),
    ["Authorization"] = "Bearer " .. tokens[n + 1],
    ["User-Agent"] = "wrk",
  }
  return wrk.format("GET", "/api/items", headers)
end
