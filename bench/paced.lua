-- wrk script for bench/bench_workers.py --pace: bench/rotate.lua's requests,
-- each connection waiting MS milliseconds before each of them, a load the
-- stack takes with room to spare instead of the most it can take. Kept
-- apart from rotate.lua: wrk sends every request of a script that has a
-- delay() through a timer, which would change the unpaced benches' load.
--
--   wrk -s bench/paced.lua URL -- delay=MS [rotate.lua's arguments]
local here = debug.getinfo(1, "S").source:sub(2):match("(.*/)") or "./"
dofile(here .. "rotate.lua")  -- its init() reads delay= into pause

function delay()
  return pause or 0
end
