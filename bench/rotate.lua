-- wrk script for bench/bench_check.py: every request comes from another
-- client. The address rotates over 100,000 IPv4 values in X-Forwarded-For
-- (trusted from loopback by the rules' client_ip.trusted_proxies), with a
-- varying x-api-key and ?q=, so that Sluice tracks and evicts keys as under
-- an attack from many addresses. Each wrk thread starts at its own offset.
--
--   wrk -s bench/rotate.lua URL              through a front door: GET /api/items?q=...
--   wrk -s bench/rotate.lua URL -- direct    straight to a check endpoint, with the
--                                            headers nginx's check subrequest adds
--   wrk -s bench/rotate.lua URL -- addresses=N
--                                            rotate over N addresses instead (1: one client)
local ADDRESSES = 100000
local thread_count = 0

function setup(thread)
  thread:set("thread_id", thread_count)
  thread_count = thread_count + 1
end

local counter = 0
local direct = false

function init(args)
  counter = (thread_id or 0) * 50021
  for _, arg in ipairs(args) do
    if arg == "direct" then
      direct = true
    elseif arg:sub(1, 10) == "addresses=" then
      ADDRESSES = tonumber(arg:sub(11))
    elseif arg:sub(1, 6) == "delay=" then
      pause = tonumber(arg:sub(7))  -- bench/paced.lua's delay(); none here
    end
  end
end

function request()
  counter = counter + 1
  local n = counter % ADDRESSES
  local address = string.format("10.%d.%d.%d", math.floor(n / 65536) % 256,
                                math.floor(n / 256) % 256, n % 256)
  local uri = "/api/items?q=" .. (counter % 5003)
  local headers = {
    ["X-Forwarded-For"] = address,
    ["X-Api-Key"] = "key-" .. (counter % 997),
    ["User-Agent"] = "wrk",
  }
  if direct then
    headers["X-Sluice-Client-Addr"] = "127.0.0.1"
    headers["X-Original-Method"] = "GET"
    headers["X-Original-URI"] = uri
    headers["X-Original-Host"] = "bench.example"
    return wrk.format("GET", "/v1/nginx/auth", headers)
  end
  return wrk.format("GET", uri, headers)
end
