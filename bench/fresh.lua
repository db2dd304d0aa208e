-- A fresh random Idempotency-Key on every request.
-- wrk -s bench/fresh.lua URL -- API_KEY SEED   (the baseline route ignores the header)
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local common = dofile(dir .. "common.lua")

local headers

setup = common.setup
done = common.done

function init(args)
  common.seed(args[2], thread_id)
  headers = common.headers(args[1])
end

function request()
  headers["Idempotency-Key"] = common.uuid4()
  return wrk.format("POST", nil, headers, common.body)
end
