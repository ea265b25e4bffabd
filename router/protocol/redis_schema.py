"""Where everything lives in Redis. One prefix per deployment, so several can share a Redis.

  {p}:replicas         SET   replica ids that have registered (for garbage collection)
  {p}:hb:{rid}         HASH  load of a live replica (running, waiting, pending_prefill_tokens,
                             free_blocks, cached_blocks, capacity_blocks); short TTL
  {p}:blocks:{rid}     SET   block hashes (decimal) the replica holds, up to the publish depth
  {p}:session:{sid}    STR   replica that served the session's last turn; sliding TTL

Only hashes, replica ids and counters are stored: never prompt text.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RedisKeys:
    prefix: str = "prefixgate"

    @property
    def replicas(self) -> str:
        return f"{self.prefix}:replicas"

    def heartbeat(self, replica_id: str) -> str:
        return f"{self.prefix}:hb:{replica_id}"

    def blocks(self, replica_id: str) -> str:
        return f"{self.prefix}:blocks:{replica_id}"

    def session(self, session_id: str) -> str:
        return f"{self.prefix}:session:{session_id}"


# Drop the index entries of replicas whose heartbeat expired. ARGV[1] = key prefix.
GC_SCRIPT = """
local prefix = ARGV[1]
local removed = 0
for _, rid in ipairs(redis.call('SMEMBERS', prefix .. ':replicas')) do
  if redis.call('EXISTS', prefix .. ':hb:' .. rid) == 0 then
    redis.call('DEL', prefix .. ':blocks:' .. rid)
    redis.call('SREM', prefix .. ':replicas', rid)
    removed = removed + 1
  end
end
return removed
"""

HEARTBEAT_FIELDS = ("running", "waiting", "pending_prefill_tokens", "free_blocks", "cached_blocks", "capacity_blocks")

# One round trip per routing decision. ARGV = prefix, session key or "", number of replicas,
# replica ids..., block hashes... Returns {session_replica or false, {rid, matched, load}...}:
# for each replica the count of leading blocks it holds and its HEARTBEAT_FIELDS in order
# (an empty list when its heartbeat expired: a dead replica's blocks never count).
LOOKUP_SCRIPT = """
local prefix = ARGV[1]
local session = false
if ARGV[2] ~= '' then session = redis.call('GET', ARGV[2]) end
local n = tonumber(ARGV[3])
local first_hash = 4 + n
local out = {session}
for i = 1, n do
  local rid = ARGV[3 + i]
  local hb = {}
  local matched = 0
  if redis.call('EXISTS', prefix .. ':hb:' .. rid) == 1 then
    hb = redis.call('HMGET', prefix .. ':hb:' .. rid, 'running', 'waiting', 'pending_prefill_tokens',
                    'free_blocks', 'cached_blocks', 'capacity_blocks')
    local key = prefix .. ':blocks:' .. rid
    for j = first_hash, #ARGV do
      if redis.call('SISMEMBER', key, ARGV[j]) == 1 then matched = matched + 1 else break end
    end
  end
  out[#out + 1] = {rid, matched, hb}
end
return out
"""
