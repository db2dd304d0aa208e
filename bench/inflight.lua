-- Many clients on a few keys at once, with the latency of every response recorded by status.
-- Run with one connection per thread (wrk -t N -c N), so a thread's request() and response() pair up.
-- wrk -s bench/inflight.lua URL -- API_KEY SEED NONCE SLOT_MS NKEYS OUTFILE [shared]
--
-- Thread t always sends key t % NKEYS of the current time slot, and every SLOT_MS milliseconds all
-- threads move to NKEYS new keys together: each key is sent by N / NKEYS clients at once, so the first
-- one is still running when the others arrive (409), and later ones find it finished (replayed).
--
-- With "shared", a thread drives several connections (wrk -t 2 -c N): their requests and responses do
-- not pair up, so each request takes the thread's next key of the slot in turn, and a response records
-- its status only (latency 0, key "-"); the server's access log has the latencies.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local common = dofile(dir .. "common.lua")
local ffi = require("ffi")

ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } bench_timespec;
int clock_gettime(int clk_id, bench_timespec *tp);
]]
local CLOCK_MONOTONIC = 1
local ts = ffi.new("bench_timespec")

local function now_us()
  ffi.C.clock_gettime(CLOCK_MONOTONIC, ts)
  return tonumber(ts.tv_sec) * 1000000 + tonumber(ts.tv_nsec) / 1000
end

local headers, nonce, slot_ms, nkeys, shared
local started, key
local sent = 0
samples = {}  -- "status latency_us key" per response; read by done() through thread:get()
outfile = nil  -- a global too: done() runs in the main Lua state, which gets no args

local threads = {}
function setup(thread)
  common.setup(thread)
  threads[#threads + 1] = thread
end

function init(args)
  common.seed(args[2], thread_id)
  headers = common.headers(args[1])
  nonce, slot_ms, nkeys, outfile = args[3], tonumber(args[4]), tonumber(args[5]), args[6]
  shared = args[7] == "shared"
end

function request()
  local slot = math.floor(now_us() / 1000 / slot_ms)
  local index = thread_id % nkeys
  if shared then
    index, sent = (thread_id + sent) % nkeys, sent + 1
  end
  key = string.format("%s-0000-4000-8%03x-%012x", nonce, index, slot)
  headers["Idempotency-Key"] = key
  started = now_us()
  return wrk.format("POST", nil, headers, common.body)
end

function response(status, _, _)
  if shared then
    samples[#samples + 1] = string.format("%d 0 -", status)
  else
    samples[#samples + 1] = string.format("%d %d %s", status, now_us() - started, key)
  end
end

function done(summary, latency, requests)
  common.done(summary, latency, requests)
  local out = assert(io.open(threads[1]:get("outfile"), "w"))
  for _, thread in ipairs(threads) do
    for _, line in ipairs(thread:get("samples")) do out:write(line, "\n") end
  end
  out:close()
end
