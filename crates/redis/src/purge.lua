local now = now_ms()
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('TYPE', key)['ok'] == 'hash' then
    local r = redis.call('HMGET', key, 'state', 'expires_at')
    local expires_at = tonumber(r[2])
    if (r[1] == 'in_flight' or r[1] == 'completed') and expires_at and expires_at <= now then
      redis.call('DEL', key)
      n = n + 1
    end
  end
end
return n
