local key = KEYS[1]
if redis.call('TYPE', key)['ok'] ~= 'hash' then
  return 0
end
local r = redis.call('HMGET', key, 'token', 'state')
if r[1] == ARGV[2] and r[2] == 'in_flight' then
  redis.call('DEL', key)
  redis.call('PUBLISH', ARGV[3], ARGV[4])
  return 1
end
return 0
