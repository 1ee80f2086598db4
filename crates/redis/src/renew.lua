local key = KEYS[1]
if redis.call('TYPE', key)['ok'] ~= 'hash' then
  return 0
end
local now = now_ms()
local r = redis.call('HMGET', key, 'token', 'state', 'expires_at')
local expires_at = tonumber(r[3])
if r[1] == ARGV[2] and r[2] == 'in_flight' and expires_at and expires_at > now then
  redis.call('HSET', key, 'lease_until', int(now + tonumber(ARGV[3])))
  return 1
end
return 0
