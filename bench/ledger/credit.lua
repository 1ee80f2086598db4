-- One new idempotency key per request: a run id (wrk's first script
-- argument, else the time), the thread id and a counter.
local counter = 0
local tid = 0
local run = ""

function setup(thread)
  tid = tid + 1
  thread:set("tid", tid)
end
function init(args)
  counter = 0
  run = args[1] or tostring(os.time())
end
request = function()
  counter = counter + 1
  local key = string.format('"wrk-%s-%d-%d"', run, tid, counter)
  return wrk.format("POST", "/accounts/1/credits", {
    ["Content-Type"] = "application/json",
    ["Authorization"] = "Bearer bench",
    ["Idempotency-Key"] = key,
  }, '{"amount": 5}')
end
done = function(summary, latency, requests)
  io.write(string.format("STATUS requests=%d errors_status=%d\n", summary.requests, summary.errors.status))
end
