"""The Lua scripts of :class:`~idemq.RedisStore`: each primitive is one atomic round trip.

A script reads and writes records in the format of :mod:`.records` (the values of
``RECORD_FIELDS`` joined by NUL); the field positions below are named after those fields.
Scripts only split PROCESSING records (their result is empty) or read the values before the
result, so a NUL inside a result can never shift a field.

Leases are set and judged on Redis's own clock (``TIME``) when a time in ARGV is empty (the
store's ``lease_clock="store"``, its default), or on the guard's injected clock when the caller
sends one (``lease_clock="client"``, for tests that move time with a fake clock). Redis's clock
also drives the PX garbage collection, which is deliberately longer than any lease. A script
may read ``TIME`` and then write: Redis 7 replicates a script's effects, not the script.

Every script is safe to run twice with the same arguments: redis-py retries a command whose
reply was lost on a broken connection, so a claim/complete may reach the server twice.
"""

from __future__ import annotations

from idemq.drivers.redis import LuaScript

__all__ = [
    "CLAIM",
    "CLAIM_ARGC",
    "CLAIM_MANY",
    "COMPLETE",
    "FORCE_RELEASE",
    "FORGET",
    "PURGE",
    "RELEASE",
    "RENEW",
]

CLAIM_ARGC = 6
"""ARGV values per claimed message (CLAIM and CLAIM_MANY)."""

# The positions of RECORD_FIELDS, and split(record): the values of a record as a Lua table.
# Lua 5.1 patterns spell NUL "%z".
_RECORD_FUNCTIONS = """
local OWNER, LEASE_UNTIL_MS, ATTEMPTS, PROCESSED_MS, PAYLOAD_HASH = 2, 3, 4, 6, 8
local FIELD_COUNT = 9
-- The time a script judges by: ARGV's, or Redis's clock when the caller sent ''. Kept as
-- decimal text (concatenated, never through a Lua double, which prints 16 digits as 1e+15).
local function now_or_server(now_ms)
  if now_ms ~= '' then return now_ms end
  local t = redis.call('TIME')
  return t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
end
-- A won claim's fencing token: Redis's clock in epoch microseconds, as decimal text.
local function fence_us()
  local t = redis.call('TIME')
  return t[1] .. string.format('%06d', tonumber(t[2]))
end
local function plus(ms, more)
  return string.format('%.0f', tonumber(ms) + tonumber(more))
end
local function split(record)
  local v = {}
  for value in string.gmatch(record .. '\\0', '([^%z]*)%z') do
    v[#v + 1] = value
  end
  return v
end
"""

# claim(key, owner, now_ms ('' = Redis's TIME), lease_ms, gc_ms, business_id, payload_hash)
# Returns {1, fence} when `owner` now holds the record (fence: Redis's TIME in epoch
# microseconds), else the stored record itself, so a duplicate needs no second command.
_CLAIM_FUNCTION = (
    _RECORD_FUNCTIONS
    + """
local function claim(key, owner, now_ms, lease_ms, gc_ms, business_id, payload_hash)
  local cur = redis.call('GET', key)
  -- PROCESSED (or not a record): the answer is the record as it is, whatever the time, so a
  -- duplicate reads no clock.
  if cur and string.sub(cur, 1, 2) ~= '0\\0' then return cur end
  now_ms = now_or_server(now_ms)
  local until_ms = plus(now_ms, lease_ms)
  if not cur then
    -- GC only (PX): a crashed worker's record must outlive its lease (so a redelivery can see
    -- and take it over) and then disappear; the lease itself is judged on now_ms.
    -- status, owner, lease_until_ms, attempts, created_ms, processed_ms, business_id,
    -- payload_hash, result: the same fresh record records.format_record writes.
    redis.call('SET', key, table.concat(
      {'0', owner, until_ms, '1', now_ms, '', business_id, payload_hash, ''}, '\\0'),
      'PX', gc_ms)
    return {1, fence_us()}
  end
  local v = split(cur)
  -- Our own claim, replayed by a client retry after a lost reply: still ours.
  if v[OWNER] == owner then return {1, fence_us()} end
  local stored_hash = v[PAYLOAD_HASH] or ''
  local same_payload = stored_hash == '' or payload_hash == '' or stored_hash == payload_hash
  -- Takeover only of an expired lease, and never for another payload under the same id:
  -- handing back the record lets the guard raise PayloadMismatchError instead.
  if #v == FIELD_COUNT and tonumber(v[LEASE_UNTIL_MS]) <= tonumber(now_ms) and same_payload then
    v[OWNER] = owner
    v[LEASE_UNTIL_MS] = until_ms
    v[ATTEMPTS] = tostring(tonumber(v[ATTEMPTS]) + 1)
    if stored_hash == '' then v[PAYLOAD_HASH] = payload_hash end
    redis.call('SET', key, table.concat(v, '\\0'), 'PX', gc_ms)
    return {1, fence_us()}
  end
  return cur
end
"""
)

CLAIM = LuaScript(
    "claim",
    _CLAIM_FUNCTION
    + """
-- KEYS[1] record
-- ARGV[1] owner  ARGV[2] now_ms ('' = Redis's TIME)  ARGV[3] lease_ms  ARGV[4] gc_ms
-- ARGV[5] business_id ('' = none)  ARGV[6] payload_hash ('' = none)
-- Returns {1, fence} (claimed: fresh or takeover) or the existing record as stored.
return claim(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
""",
)

CLAIM_MANY = LuaScript(
    "claim_many",
    _CLAIM_FUNCTION
    + """
-- KEYS[i] record of message i
-- ARGV[6(i-1)+1 .. 6i] message i's owner, now_ms, lease_ms, gc_ms, business_id, hash
-- Returns an array, one entry per key in order: {1, fence} or the existing record as stored.
local out = {}
for i = 1, #KEYS do
  local j = (i - 1) * 6
  out[i] = claim(KEYS[i], ARGV[j + 1], ARGV[j + 2], ARGV[j + 3], ARGV[j + 4], ARGV[j + 5],
                 ARGV[j + 6])
end
return out
""",
)

COMPLETE = LuaScript(
    "complete",
    """
-- KEYS[1] record
-- ARGV[1] owner  ARGV[2] result JSON text  ARGV[3] now_ms ('' = Redis's TIME)
-- ARGV[4] ttl_ms (retention)
-- Returns 1 when the record is PROCESSED by ARGV[1] (now, or already by a replayed call);
-- 0 when ARGV[1] lost it (taken over after its lease expired, released, or expired away):
-- a paused worker's late result must never overwrite the new owner's record.
local cur = redis.call('GET', KEYS[1])
if not cur then return 0 end
local head = '0\\0' .. ARGV[1] .. '\\0'
if string.sub(cur, 1, #head) ~= head then
  return string.sub(cur, 1, #head) == '1\\0' .. ARGV[1] .. '\\0' and 1 or 0
end
-- ARGV[1]'s PROCESSING record: status 0, owner, lease_until_ms, attempts, created_ms,
-- processed_ms '', business_id, payload_hash, result ''. Completing sets status 1, empties
-- lease_until_ms and fills processed_ms and result. Redis runs one script at a time and this
-- one runs once per message, so it copies the values it keeps in two slices (attempts and
-- created_ms with their NULs; business_id and payload_hash with theirs) instead of splitting
-- the record into nine strings and joining them again.
local lease_end = string.find(cur, '\\0', #head + 1, true)
local attempts_end = lease_end and string.find(cur, '\\0', lease_end + 1, true)
local created_end = attempts_end and string.find(cur, '\\0', attempts_end + 1, true)
-- Not the nine values of a claim (processed_ms and result must be empty): left as it is, so
-- nothing is written that no reader could parse.
if not created_end or string.byte(cur, created_end + 1) ~= 0 or string.byte(cur, -1) ~= 0 then
  return redis.error_reply('malformed idemq record')
end
local now_ms = ARGV[3]
if now_ms == '' then
  local t = redis.call('TIME')
  now_ms = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
end
redis.call('SET', KEYS[1],
  '1\\0' .. ARGV[1] .. '\\0' .. string.sub(cur, lease_end, created_end) .. now_ms
    .. string.sub(cur, created_end + 1) .. ARGV[2],
  'PX', ARGV[4])
return 1
""",
)

RENEW = LuaScript(
    "renew",
    _RECORD_FUNCTIONS
    + """
-- KEYS[1] record
-- ARGV[1] owner  ARGV[2] lease_until_ms ('' = Redis's TIME plus ARGV[4])
-- ARGV[3] gc_ms (lease left plus the retention ttl)  ARGV[4] lease_ms
-- Returns 1 when ARGV[1] still holds the PROCESSING record and its lease now runs to ARGV[2],
-- 0 when ARGV[1] lost it (taken over, released, expired away): a worker must learn it lost
-- the claim before it completes, not by overwriting the new owner's record.
local cur = redis.call('GET', KEYS[1])
if not cur then return 0 end
local head = '0\\0' .. ARGV[1] .. '\\0'
if string.sub(cur, 1, #head) ~= head then return 0 end
local v = split(cur)
if #v ~= FIELD_COUNT then return redis.error_reply('malformed idemq record') end
if ARGV[2] == '' then
  v[LEASE_UNTIL_MS] = plus(now_or_server(''), ARGV[4])
else
  v[LEASE_UNTIL_MS] = ARGV[2]
end
redis.call('SET', KEYS[1], table.concat(v, '\\0'), 'PX', ARGV[3])
return 1
""",
)

RELEASE = LuaScript(
    "release",
    """
-- KEYS[1] record
-- ARGV[1] owner
-- Returns 1 when the PROCESSING record of ARGV[1] was deleted, 0 (no-op) otherwise: a worker
-- whose lease was taken over must not delete the new owner's claim.
-- A record starts with its status and owner: "0" NUL owner NUL is ARGV[1]'s PROCESSING one.
local cur = redis.call('GET', KEYS[1])
local mine = '0\\0' .. ARGV[1] .. '\\0'
if cur and string.sub(cur, 1, #mine) == mine then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
""",
)

FORCE_RELEASE = LuaScript(
    "force_release",
    """
-- KEYS[1] record
-- Returns 1 when a PROCESSING record was deleted whoever owned it (the operator's override of
-- a stuck lease), 0 otherwise. The status check is here, not in the client: between an
-- operator's look and this call the record may have been completed, and deleting a PROCESSED
-- record would let its message run twice.
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, 2) == '0\\0' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
""",
)

FORGET = LuaScript(
    "forget",
    _RECORD_FUNCTIONS
    + """
-- KEYS[1] record
-- ARGV[1] now_ms ('' = Redis's TIME)  ARGV[2] force ('1' or '0')
-- Returns 1 when the record was deleted, 0 when there was none, -1 when it is a live lease and
-- force was not given (refused: its holder may be mid-effect). Judged here, not in the client:
-- between an operator's look and this call the record may have been claimed again.
local cur = redis.call('GET', KEYS[1])
if not cur then return 0 end
if ARGV[2] ~= '1' and string.sub(cur, 1, 2) == '0\\0' then
  local lease_until_ms = tonumber(split(cur)[LEASE_UNTIL_MS] or '')
  if lease_until_ms and lease_until_ms > tonumber(now_or_server(ARGV[1])) then return -1 end
end
redis.call('DEL', KEYS[1])
return 1
""",
)

PURGE = LuaScript(
    "purge",
    _RECORD_FUNCTIONS
    + """
-- KEYS[i] candidate records (found by SCAN, so possibly changed since)
-- ARGV[1] cutoff_ms: delete PROCESSED records processed before it
-- Returns how many were deleted. The status is re-checked here because between SCAN and now
-- a record may have expired and been claimed again: deleting that claim would let its
-- message run twice.
local n = 0
for i = 1, #KEYS do
  local cur = redis.call('GET', KEYS[i])
  if cur and string.sub(cur, 1, 2) == '1\\0' then
    local processed_ms = tonumber(split(cur)[PROCESSED_MS] or '')
    if processed_ms and processed_ms < tonumber(ARGV[1]) then
      redis.call('DEL', KEYS[i])
      n = n + 1
    end
  end
end
return n
""",
)
