-- Shared by the wrk scripts of bench/: the request, random keys, and the BENCH line run.py parses.
local M = {}

M.body = '{"amount": 1250, "currency": "EUR"}'

function M.headers(api_key)
  return { ["Content-Type"] = "application/json", ["Authorization"] = "Bearer " .. api_key }
end

-- Seed each thread differently: run.py passes a seed, setup() numbers the threads.
function M.seed(run_seed, thread_id)
  math.randomseed(tonumber(run_seed) * 1000 + thread_id)
  for _ = 1, 10 do math.random() end
end

-- A random UUID version 4 (RFC 9562): 122 random bits, version nibble 4, variant bits 10.
function M.uuid4()
  return string.format("%06x%02x-%04x-4%03x-%x%03x-%06x%06x",
    math.random(0, 0xffffff), math.random(0, 0xff), math.random(0, 0xffff), math.random(0, 0xfff),
    math.random(8, 11), math.random(0, 0xfff), math.random(0, 0xffffff), math.random(0, 0xffffff))
end

-- Number the threads in setup() (runs in wrk's main Lua state, once per thread, before init()).
local next_id = 0
function M.setup(thread)
  next_id = next_id + 1
  thread:set("thread_id", next_id)
end

function M.done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH requests=%d duration_us=%d p50_us=%d p99_us=%d status_errors=%d socket_errors=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.status, e.connect + e.read + e.write + e.timeout))
end

return M
