local key = KEYS[1]
if redis.call('TYPE', key)['ok'] ~= 'hash' then
  return 0
end
local r = redis.call('HMGET', key, 'token', 'state', 'expires_at')
if r[1] ~= ARGV[2] or r[2] ~= 'in_flight' then
  return 0
end
local remaining = (tonumber(r[3]) or 0) - now_ms()
if remaining <= 0 then
  return 0
end
redis.call('HSET', key, 'state', 'completed', 'response', ARGV[3])
redis.call('PEXPIRE', key, int(remaining))
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
