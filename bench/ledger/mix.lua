-- A third each, in turn: a credit with a new key, a replay, GET
-- /accounts/1. wrk's script arguments: a name for the run, so that keys
-- never repeat, and optionally a TTL in seconds. Without a TTL the replays
-- are of "replay-1"; with one (retention.sh, where "replay-1" expires),
-- of one of this run's credits chosen at random among those sent between
-- TTL/2 and 2 s ago (a GET until there is one). Prints how many credits
-- and replays it sent, and the first answers of each status other than 2xx.
local run, counter, ttl = "", 0, nil
local sent_by = {} -- second -> credits sent before it
credits, replays = 0, 0 -- globals: done() reads them through thread:get
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args)
  run = args[1] or tostring(os.time())
  ttl = tonumber(args[2])
  math.randomseed(os.time())
end
local h = {
  ["Content-Type"] = "application/json",
  ["Authorization"] = "Bearer bench",
}
-- The key a replay repeats, or nil when there is none yet.
local function replayed()
  if not ttl then return '"replay-1"' end
  local now = os.time()
  sent_by[now] = sent_by[now] or credits
  local lo, hi = sent_by[now - math.floor(ttl / 2)] or 1, sent_by[now - 2]
  if hi and hi > lo then
    return string.format('"mix-%s-%d"', run, math.random(lo, hi))
  end
end
request = function()
  counter = counter + 1
  local kind = counter % 3
  local key = kind == 2 and replayed()
  if kind == 1 then
    credits = credits + 1
    h["Idempotency-Key"] = string.format('"mix-%s-%d"', run, credits)
  elseif key then
    replays = replays + 1
    h["Idempotency-Key"] = key
  else
    return wrk.format("GET", "/accounts/1", h)
  end
  local r = wrk.format("POST", "/accounts/1/credits", h, '{"amount": 5}')
  h["Idempotency-Key"] = nil
  return r
end
local statuses = {}
response = function(status, headers, body)
  if status >= 300 then
    statuses[status] = (statuses[status] or 0) + 1
    if statuses[status] <= 3 then io.write(string.format("ANSWER %d %s\n", status, body)) end
  end
end
done = function(summary, latency, requests)
  local c, r = 0, 0
  for _, t in ipairs(threads) do c, r = c + t:get("credits"), r + t:get("replays") end
  io.write(string.format("MIX sent_credits=%d sent_replays=%d\n", c, r))
end
