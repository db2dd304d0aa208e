-- Replays: cycles through keys that were each used once already (one key per line in KEYFILE).
-- wrk -s bench/replay.lua URL -- API_KEY SEED KEYFILE
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local common = dofile(dir .. "common.lua")

local headers
local keys = {}
local i

setup = common.setup
done = common.done

function init(args)
  common.seed(args[2], thread_id)
  headers = common.headers(args[1])
  for line in io.lines(args[3]) do keys[#keys + 1] = line end
  i = math.random(1, #keys)  -- each thread starts somewhere else in the list
end

function request()
  i = i % #keys + 1
  headers["Idempotency-Key"] = keys[i]
  return wrk.format("POST", nil, headers, common.body)
end
