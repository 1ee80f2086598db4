local key = KEYS[1]
local now = now_ms()
local function acquire(taken_over)
  redis.call('DEL', key)
  redis.call('HSET', key,
    'fingerprint', ARGV[2],
    'token', ARGV[3],
    'state', 'in_flight',
    'lease_until', int(now + tonumber(ARGV[4])),
    'expires_at', int(now + tonumber(ARGV[5])))
  redis.call('PEXPIRE', key, ARGV[5])
  return {'acquired', taken_over}
end
local kind = redis.call('TYPE', key)['ok']
if kind == 'none' then
  return acquire(0)
end
if kind ~= 'hash' then
  return {'corrupt', 'the key holds a ' .. kind .. ', not a hash'}
end
local r = redis.call('HMGET', key, 'fingerprint', 'state', 'lease_until', 'expires_at')
local expires_at = tonumber(r[4])
if not expires_at then
  return {'corrupt', 'expires_at is missing or not a number'}
end
if expires_at <= now then
  return acquire(0)
end
if type(r[1]) ~= 'string' then
  return {'corrupt', 'the fingerprint is missing'}
end
if r[1] ~= ARGV[2] then
  return {'mismatch'}
end
if r[2] == 'completed' then
  local response = redis.call('HGET', key, 'response')
  if type(response) ~= 'string' then
    return {'corrupt', 'a completed record without a response'}
  end
  return {'completed', response, expires_at - now}
end
if r[2] ~= 'in_flight' then
  return {'corrupt', 'the state is neither in_flight nor completed'}
end
local lease_until = tonumber(r[3])
if not lease_until then
  return {'corrupt', 'lease_until is missing or not a number'}
end
-- A deadline further ahead than this claim's lease (ARGV[4]) is one the
-- clock stepped back from: the lease counts as over (decide.rs, lease_alive).
if lease_until > now and lease_until - now <= tonumber(ARGV[4]) then
  return {'in_flight', lease_until - now}
end
return acquire(1)
