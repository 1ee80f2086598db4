-- A third each, in turn: a credit with a new key, a replay of "replay-1",
-- GET /accounts/1. wrk's first script argument names the run, so that keys
-- never repeat. Prints how many credits of each kind it sent.
local run, counter = "", 0
credits, replays = 0, 0 -- globals: done() reads them through thread:get
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args)
  run = args[1] or tostring(os.time())
end
local h = {
  ["Content-Type"] = "application/json",
  ["Authorization"] = "Bearer bench",
}
request = function()
  counter = counter + 1
  local kind = counter % 3
  if kind == 0 then
    return wrk.format("GET", "/accounts/1", h)
  end
  if kind == 1 then
    credits = credits + 1
    h["Idempotency-Key"] = string.format('"mix-%s-%d"', run, counter)
  else
    replays = replays + 1
    h["Idempotency-Key"] = '"replay-1"'
  end
  local r = wrk.format("POST", "/accounts/1/credits", h, '{"amount": 5}')
  h["Idempotency-Key"] = nil
  return r
end
done = function(summary, latency, requests)
  local c, r = 0, 0
  for _, t in ipairs(threads) do c, r = c + t:get("credits"), r + t:get("replays") end
  io.write(string.format("MIX sent_credits=%d sent_replays=%d\n", c, r))
end
