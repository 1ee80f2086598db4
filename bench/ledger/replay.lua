-- The same key and body on every request: replays.
request = function()
  return wrk.format("POST", "/accounts/1/credits", {
    ["Content-Type"] = "application/json",
    ["Authorization"] = "Bearer bench",
    ["Idempotency-Key"] = '"replay-1"',
  }, '{"amount": 5}')
end
done = function(summary, latency, requests)
  io.write(string.format("STATUS requests=%d errors_status=%d\n", summary.requests, summary.errors.status))
end
