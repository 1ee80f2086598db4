-- One new idempotency key per request: thread id and a counter.
local counter = 0
local tid = 0

function setup(thread)
  tid = tid + 1
  thread:set("tid", tid)
end
function init(args)
  counter = 0
end
request = function()
  counter = counter + 1
  local key = string.format('"wrk-%d-%d-%d"', tid, counter, math.random(1, 1000000000))
  return wrk.format("POST", "/accounts/1/credits", {
    ["Content-Type"] = "application/json",
    ["Authorization"] = "Bearer bench",
    ["Idempotency-Key"] = key,
  }, '{"amount": 5}')
end
done = function(summary, latency, requests)
  io.write(string.format("STATUS requests=%d errors_status=%d\n", summary.requests, summary.errors.status))
end
