-- Replays of stored records chosen at random: keys fill-1 .. fill-N (N is
-- wrk's first script argument), the records scale.sh fill copies from the
-- one stored for "replay-1", so the same body replays each.
local n = 1000
function init(args)
  n = tonumber(args[1]) or n
  math.randomseed(os.time())
end
request = function()
  return wrk.format("POST", "/accounts/1/credits", {
    ["Content-Type"] = "application/json",
    ["Authorization"] = "Bearer bench",
    ["Idempotency-Key"] = string.format('"fill-%d"', math.random(1, n)),
  }, '{"amount": 5}')
end
