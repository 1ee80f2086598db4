-- POST /SIDE/BYTES (wrk's script arguments: naive|layer, then the size);
-- on the layer's route always the key "size-BYTES", so every answer is a
-- replay of the first.
local req
function init(args)
  req = wrk.format("POST", "/" .. args[1] .. "/" .. args[2], {
    ["x-user"] = "bench",
    ["Idempotency-Key"] = '"size-' .. args[2] .. '"',
  })
end
request = function() return req end
