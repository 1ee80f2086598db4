local now = now_ms()
local list = ARGV[2] == '1'
local counts = {0, 0, 0, 0}
local stuck = {}
for _, key in ipairs(KEYS) do
  if redis.call('TYPE', key)['ok'] == 'hash' then
    local r = redis.call('HMGET', key, 'state', 'lease_until', 'expires_at', 'fingerprint')
    local expires_at = tonumber(r[3])
    if (r[1] == 'in_flight' or r[1] == 'completed') and expires_at then
      if expires_at <= now then
        counts[4] = counts[4] + 1
      elseif r[1] == 'completed' then
        counts[3] = counts[3] + 1
      else
        local lease_until = tonumber(r[2])
        if not lease_until then
          return {'corrupt', 'lease_until is missing or not a number'}
        end
        if lease_until > now then
          counts[1] = counts[1] + 1
        else
          counts[2] = counts[2] + 1
          if list then
            table.insert(stuck, {key, r[4] or '', int(lease_until), int(expires_at)})
          end
        end
      end
    end
  end
end
return {'ok', int(now), counts[1], counts[2], counts[3], counts[4], stuck}
