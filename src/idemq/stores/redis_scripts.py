"""The Lua scripts of :class:`~idemq.RedisStore` — each primitive is one atomic round trip.

A record is one Redis hash (one key, so one Cluster slot) with these fields::

    s  status: "0" PROCESSING, "1" PROCESSED         o  owner token of the claim
    l  lease_until_ms (PROCESSING only)              a  attempts (1 + takeovers)
    c  created ms         p  processed ms            b  business id ("" = none)
    h  payload sha256 hex ("" = none)                r  result JSON text (PROCESSED only)

Every time in ARGV comes from the guard's injected clock; Redis's own clock only drives the
PEXPIRE garbage collection, which is deliberately longer than any lease.

Every script is safe to run twice with the same arguments: redis-py retries a command whose
reply was lost on a broken connection, so a claim/complete may reach the server twice.
"""

from __future__ import annotations

from idemq.stores.redis_io import LuaScript

__all__ = [
    "CLAIM",
    "CLAIM_ARGC",
    "CLAIM_MANY",
    "COMPLETE",
    "FIELDS",
    "FORCE_RELEASE",
    "PURGE",
    "RELEASE",
]

CLAIM_ARGC = 6
"""ARGV values per claimed message (CLAIM and CLAIM_MANY)."""

# encode(values): the record as ONE bulk string, the values in FIELDS order joined by NUL ('' =
# absent). One bulk string, not an array: redis-py parses every array element in Python. NUL, not
# JSON: a split is a tenth of the cost of json.loads. No value but the result can hold a NUL (ids
# and business ids are validated without it, owners and hashes are hex, the rest are digits), and
# the result is last, so the client splits at most 8 times and the result stays whole.
_RECORD_FUNCTION = """
local FIELDS = {'s', 'o', 'l', 'a', 'c', 'p', 'b', 'h', 'r'}
local function encode(v)
  for i = 1, 9 do
    if not v[i] then v[i] = '' end
  end
  return table.concat(v, '\\0')
end
"""

FIELDS = ("s", "o", "l", "a", "c", "p", "b", "h", "r")
"""Field order of the Lua FIELDS table (claim replies) and of the HMGET that get/find send."""

# claim(key, owner, now_ms, lease_until_ms, gc_ms, business_id, payload_hash)
# Returns 1 when `owner` now holds the record, else the record (see encode()), so a duplicate
# costs no second command.
_CLAIM_FUNCTION = (
    _RECORD_FUNCTION
    + """
local function claim(key, owner, now_ms, until_ms, gc_ms, business_id, payload_hash)
  -- One HMGET of every field: the same reply decides and, on conflict, is handed back.
  local cur = redis.call('HMGET', key, unpack(FIELDS))
  if not cur[1] then
    redis.call('HSET', key, 's', '0', 'o', owner, 'l', until_ms, 'a', '1', 'c', now_ms,
               'b', business_id, 'h', payload_hash)
    -- GC only: a crashed worker's record must outlive its lease (so a redelivery can see and
    -- take it over) and then disappear; the lease itself is judged on the guard's clock.
    redis.call('PEXPIRE', key, gc_ms)
    return 1
  end
  if cur[1] == '0' then
    -- Our own claim, replayed by a client retry after a lost reply: still ours.
    if cur[2] == owner then return 1 end
    local stored_hash = cur[8] or ''
    local same_payload = stored_hash == '' or payload_hash == '' or stored_hash == payload_hash
    -- Takeover only of an expired lease, and never for another payload under the same id:
    -- handing back the record lets the guard raise PayloadMismatchError instead.
    if tonumber(cur[3] or '0') <= tonumber(now_ms) and same_payload then
      redis.call('HSET', key, 'o', owner, 'l', until_ms)
      redis.call('HINCRBY', key, 'a', 1)
      if stored_hash == '' and payload_hash ~= '' then
        redis.call('HSET', key, 'h', payload_hash)
      end
      redis.call('PEXPIRE', key, gc_ms)
      return 1
    end
  end
  return encode(cur)
end
"""
)

CLAIM = LuaScript(
    "claim",
    _CLAIM_FUNCTION
    + """
-- KEYS[1] record hash
-- ARGV[1] owner  ARGV[2] now_ms  ARGV[3] lease_until_ms  ARGV[4] gc_ms
-- ARGV[5] business_id ('' = none)  ARGV[6] payload_hash ('' = none)
-- Returns 1 (claimed: fresh or takeover) or the existing record (see encode()).
return claim(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
""",
)

CLAIM_MANY = LuaScript(
    "claim_many",
    _CLAIM_FUNCTION
    + """
-- KEYS[i] record hash of message i
-- ARGV[6(i-1)+1 .. 6i] message i's owner, now_ms, lease_until_ms, gc_ms, business_id, hash
-- Returns an array, one entry per key in order: 1 or the existing record (see encode()).
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
-- KEYS[1] record hash
-- ARGV[1] owner  ARGV[2] result JSON text  ARGV[3] now_ms  ARGV[4] ttl_ms (retention)
-- Returns 1 when the record is PROCESSED by ARGV[1] (now, or already by a replayed call);
-- 0 when ARGV[1] lost it (taken over after its lease expired, released, or expired away):
-- a paused worker's late result must never overwrite the new owner's record.
local cur = redis.call('HMGET', KEYS[1], 's', 'o')
if cur[2] ~= ARGV[1] then return 0 end
if cur[1] == '0' then
  redis.call('HSET', KEYS[1], 's', '1', 'r', ARGV[2], 'p', ARGV[3])
  redis.call('HDEL', KEYS[1], 'l')
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return 1
""",
)

RELEASE = LuaScript(
    "release",
    """
-- KEYS[1] record hash
-- ARGV[1] owner
-- Returns 1 when the PROCESSING record of ARGV[1] was deleted, 0 (no-op) otherwise: a worker
-- whose lease was taken over must not delete the new owner's claim.
local cur = redis.call('HMGET', KEYS[1], 's', 'o')
if cur[1] == '0' and cur[2] == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
""",
)

FORCE_RELEASE = LuaScript(
    "force_release",
    """
-- KEYS[1] record hash
-- Returns 1 when a PROCESSING record was deleted whoever owned it (the operator's override of
-- a stuck lease), 0 otherwise. The status check is here, not in the client: between an
-- operator's look and this call the record may have been completed, and deleting a PROCESSED
-- record would let its message run twice.
if redis.call('HGET', KEYS[1], 's') == '0' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
""",
)

PURGE = LuaScript(
    "purge",
    """
-- KEYS[i] candidate record hashes (found by SCAN, so possibly changed since)
-- ARGV[1] cutoff_ms: delete PROCESSED records processed before it
-- Returns how many were deleted. The status is re-checked here because between SCAN and now
-- a record may have expired and been claimed again: deleting that claim would let its
-- message run twice.
local n = 0
for i = 1, #KEYS do
  local cur = redis.call('HMGET', KEYS[i], 's', 'p')
  if cur[1] == '1' and tonumber(cur[2] or '0') < tonumber(ARGV[1]) then
    redis.call('DEL', KEYS[i])
    n = n + 1
  end
end
return n
""",
)
