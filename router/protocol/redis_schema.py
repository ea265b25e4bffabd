"""Where everything lives in Redis, and the one script the router runs. One prefix per
deployment, so several deployments can share a Redis (standalone or Cluster).

  {p:bK}:blk:{hash}     SET   holders of this block (the inverted index): "rid" when it is in the
                              replica's device pool, "rid|host" / "rid|disk" in a lower tier
                              (router/protocol/media.py `member`; one member per replica). K =
                              hash mod `buckets`: the hash tag spreads blocks over the cluster's slots
  {p:bK}:fl:{hash}      STR   replica a router just sent this block's prompt to, before any
                              replica has computed it (in flight); a few seconds' TTL
  {p}:blocks:{rid}      SET   blocks one replica holds, "hash" (decimal) or "hash|host" /
                              "hash|disk" (media.py `entry`): resync and clean-up
  {p}:hb:{rid}          HASH  a live replica's Heartbeat (load and process facts); short TTL
  {p}:replicas          SET   replica ids that have registered (for garbage collection)
  {p}:gc-lease          STR   holder of this period's garbage collection (SET NX PX)
  {p}:session:{sid}     STR   replica that served the session's last turn; sliding TTL
  {p:rl:T}:req          HASH  tenant T's requests-per-minute bucket: level, ts (ms); T is a digest
  {p:rl:T}:tok          HASH  tenant T's tokens-per-minute bucket (same hash tag: one slot, one
                              script call per admission; RATE_LIMIT_SCRIPT); expire once full

Every key a script touches is passed in KEYS; the lookup script only ever receives block keys
of one hash tag at a time on a cluster (all of them at once on a standalone Redis).
Only hashes, replica ids and counters are stored: never prompt text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import msgspec


class Heartbeat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A replica's heartbeat hash, every field it writes. Routers read the load fields
    (LOAD_FIELDS, integers); operators, the fault tests and the fleet harness read the rest."""

    running: int = 0
    waiting: int = 0
    pending_prefill_tokens: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    capacity_blocks: int = 0
    # measured on the replica (0 until measured), for pricing pulls against recompute:
    kv_pull_bytes_per_s: int = 0  # K/V bytes per second of its recent pulls from other replicas
    prefill_tokens_per_s: int = 0  # prompt tokens computed per second of prefill, recent requests
    kv_bytes_per_token: int = 0  # K/V bytes one token occupies in its pool (what a pull moves per token)
    kv_pull: int = 0  # 1: the replica exports and imports K/V, so pull hints may name it
    # a decode replica's requests waiting on a prefill replica's hand-over (also counted in `waiting`)
    handovers_in_flight: int = 0
    # K/V tiers below the device pool (router/protocol/media.py): occupancy in blocks,
    # and the measured bytes/s of bringing a block back from each tier into the pool (0: none yet)
    host_blocks: int = 0
    host_capacity_blocks: int = 0
    disk_blocks: int = 0
    disk_capacity_blocks: int = 0
    kv_host_bytes_per_s: int = 0
    kv_disk_bytes_per_s: int = 0
    # LoRA: the adapters resident in the replica's host memory (identities, space-separated: a
    # request under one of them starts without reading it from disk), and the measured time of
    # reading one from disk, ms (0: none read yet)
    lora_resident: str = ""
    lora_load_ms: int = 0
    # what the router's latency model (router/latency_model.py) learns from: the tokens of the
    # requests running now, the most tokens one step schedules (0: unknown), and the replica's
    # steps, cumulative since it started (a router takes the difference of two reads: one sample
    # of the mean step over that interval; a total that went down is a restart): how many, their
    # wall time (us), and their prefill tokens, decode rows, context tokens (K/V read) and the
    # requests that started in them
    context_tokens: int = 0
    step_token_budget: int = 0
    # the work not started yet by its scheduling priority (lower first: gateway/flow/tiers.py
    # replica_priority), "priority:requests:tokens" entries space-separated, ascending: requests
    # waiting and prompt tokens not computed yet (waiting and running prefills). A request of
    # priority p waits only for the entries <= p (`queued_ahead`). "" with work pending: the
    # engine does not say (the totals above count for every priority)
    queued_by_priority: str = ""
    step_count: int = 0
    step_us: int = 0
    step_prefill_tokens: int = 0
    step_rows: int = 0
    step_context_tokens: int = 0
    step_started: int = 0
    # not read by routers
    pid: int = 0  # the replica's process (operators, the fault tests)
    generated_tokens: int = 0  # output tokens since start (tests see whether an aborted request stopped)
    step_lag: float | None = None  # sim engine: actual / modelled step time - 1 (the fleet harness)

    def to_redis(self) -> dict[str, int | float]:
        """The HSET mapping: every field, but none left unset (Redis stores no None)."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


class FlowSeats(msgspec.Struct, kw_only=True):
    """One gateway's seats in flight to a model's replicas, per tenant, as it last wrote them
    into the model's `flow_seats` hash (field: the gateway's id). Every gateway of the model
    reads the others', so a tenant's share of the seats is judged fleet-wide
    (gateway/flow/saturation.py Ledger.over_share), not per gateway."""

    t: float  # unix time written (an entry older than the readers' max age counts for nothing)
    in_flight: int  # every seat of the gateway, anonymous requests included
    seats: dict[str, int] = {}  # tenant -> seats in flight (tenants holding none left out)
    anonymous: int = 0  # seats of requests without an API key (one flow, as in the gateway's queue)


# What a router's load table reads of each heartbeat (one HMGET per replica), in this order.
LOAD_FIELDS: tuple[str, ...] = tuple(f for f in Heartbeat.__struct_fields__ if f not in ("pid", "generated_tokens", "step_lag"))


# Key prefix of a deployment that names none (several deployments can share one Redis).
DEFAULT_KEY_PREFIX = "prefixgate"

# The longest a routing decision waits for Redis (then it routes without the index). One value
# for RedisConfig, the router and the gateway's AppConfig.redis_timeout_s.
LOOKUP_TIMEOUT_S = 0.05

# Hash tags the inverted index spreads over: every writer (publisher, vLLM adapter) and reader
# (router) must use the same number, or they address different keys.
INDEX_BUCKETS = 16

# How long an in-flight key ({p:bK}:fl:{hash}) and a router's own in-flight memory last: long
# enough for a replica to finish the prefill and publish its blocks, its queue included. On a
# loaded CPU replica a prompt can wait well over 3 s (the old value) before it is computed, and
# the next request of the same new prefix then looked cold everywhere and was computed twice
# (docs/vllm.md). A mark outliving an aborted request costs at most one miss.
INFLIGHT_TTL_S = 20.0

_TEXT_FIELDS = frozenset({"lora_resident", "queued_by_priority"})  # the load fields that are not integers


def queued_by_priority(queued: Mapping[int, tuple[int, int]]) -> str:
    """The Heartbeat's queued_by_priority from {priority: (requests waiting, prompt tokens not
    computed)}."""
    return " ".join(f"{p}:{n}:{t}" for p, (n, t) in sorted(queued.items()))


def queued_ahead(load: Mapping[str, int | str], priority: int) -> tuple[int, int]:
    """(requests waiting, prompt tokens not computed) that a new request of `priority` waits for
    on a replica whose heartbeat is `load`: the entries of queued_by_priority at or before its
    priority (ties: arrival order, so they are ahead), or the totals when the replica does not
    break them down. A malformed entry is a ValueError."""
    text = load.get("queued_by_priority") or ""
    waiting, pending = int(load.get("waiting", 0) or 0), int(load.get("pending_prefill_tokens", 0) or 0)
    if not text:
        return waiting, pending
    n = t = total_requests = total_tokens = 0
    for entry in str(text).split():  # one pass: the entries ahead, and every entry's work
        p, requests, tokens = (int(x) for x in entry.split(":"))
        total_requests, total_tokens = total_requests + requests, total_tokens + tokens
        if p <= priority:
            n, t = n + requests, t + tokens
    # work the breakdown does not hold (pulls and hand-overs in flight, counted in the totals but
    # not in the engine yet) is ahead of everyone
    return min(n + max(waiting - total_requests, 0), waiting), t + max(pending - total_tokens, 0)


def parse_heartbeat(values: list) -> dict[str, int | str] | None:
    """HMGET answer (in LOAD_FIELDS order) -> load dict; None when the hash is gone."""
    if values is None or all(v is None for v in values):
        return None
    return {k: _text(v) if k in _TEXT_FIELDS else int(v or 0) for k, v in zip(LOAD_FIELDS, values, strict=True)}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


@dataclass(frozen=True)
class RedisKeys:
    prefix: str = DEFAULT_KEY_PREFIX
    buckets: int = INDEX_BUCKETS

    def __post_init__(self) -> None:
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError(f"key prefix {self.prefix!r} must not contain braces (Redis Cluster hash tags)")
        if self.buckets < 1:
            raise ValueError("buckets must be >= 1")

    def bucket(self, block_hash: int) -> int:
        return block_hash % self.buckets

    def block(self, block_hash: int) -> str:
        """Inverted-index key of one block: which replicas hold it."""
        return f"{{{self.prefix}:b{block_hash % self.buckets}}}:blk:{block_hash}"

    @property
    def block_pattern(self) -> str:
        """SCAN pattern matching every inverted-index key (on every shard of a cluster)."""
        return f"{{{self.prefix}:b*}}:blk:*"

    def inflight(self, block_hash: int) -> str:
        """Where a router just sent this block (same hash tag as the block's key)."""
        return f"{{{self.prefix}:b{block_hash % self.buckets}}}:fl:{block_hash}"

    @property
    def replicas(self) -> str:
        return f"{self.prefix}:replicas"

    @property
    def gc_lease(self) -> str:
        return f"{self.prefix}:gc-lease"

    @property
    def lora_adapters(self) -> str:
        """Hash: LoRA adapter name -> its AdapterRef as JSON (those loaded at run time)."""
        return f"{self.prefix}:lora"

    def heartbeat(self, replica_id: str) -> str:
        return f"{self.prefix}:hb:{replica_id}"

    @property
    def flow_seats(self) -> str:
        """Hash: gateway id -> its FlowSeats as JSON (the model's gateways' tenants in flight)."""
        return f"{self.prefix}:flow-seats"

    def blocks(self, replica_id: str) -> str:
        """Per-replica set of the hashes it holds (what to retract when it dies)."""
        return f"{self.prefix}:blocks:{replica_id}"

    def session(self, session_id: str) -> str:
        return f"{self.prefix}:session:{session_id}"

    def rate_limit(self, tenant: str) -> tuple[str, str]:
        """A tenant's (requests, tokens) bucket keys: one hash tag, so one slot on a cluster.
        The tenant's name is digested (it may hold braces, and is no business of Redis')."""
        import hashlib

        tag = f"{{{self.prefix}:rl:{hashlib.sha1(tenant.encode()).hexdigest()[:16]}}}"
        return f"{tag}:req", f"{tag}:tok"


# One call per hash tag (per shard group) and decision. KEYS = (block key, in-flight key) pairs
# in chain order, ARGV[1] = how many holders to sample. Returns {cards, samples}: the number of
# holders of each block up to the first block nobody holds nor was just sent (blocks past a gap
# cannot be hit), and holders sampled only where that number drops (or at the last pair): since
# a replica holding block i+1 holds block i too, a drop is where some replicas' match ends, and
# the holders there match at least that deep. A block nobody holds yet but a router just sent
# counts as -1 (one holder, in flight: sampled as the replica it went to). Holders are members
# ("rid" or "rid|host"), one per replica in whichever medium holds the block, so the counts mix
# media and the router decodes the samples (router/index/redis_index.py). SCARD and GET are O(1) and
# SRANDMEMBER with a small count O(count): the cost depends on the prompt's length, never on the
# number of replicas.
LOOKUP_SCRIPT = """
local k = tonumber(ARGV[1])
local cards = {}
local pending = {}
for i = 1, #KEYS / 2 do
  local c = redis.call('SCARD', KEYS[2 * i - 1])
  if c == 0 then
    local to = redis.call('GET', KEYS[2 * i])
    if not to then break end
    c = -1
    pending[i] = to
  end
  cards[i] = c
end
local samples = {}
local n = #cards
for i = 1, n do
  if pending[i] then
    samples[i] = {pending[i]}
  elseif i == n or cards[i + 1] < cards[i] then
    samples[i] = redis.call('SRANDMEMBER', KEYS[2 * i - 1], k)
  else
    samples[i] = {}
  end
end
return {cards, samples}
"""


# One call per admission of a tenant with limits (gateway/flow/rate_limit.py). Two token
# buckets, refilled continuously: the requests one holds up to ARGV[1] (requests per minute),
# the tokens one up to ARGV[2] (tokens per minute); 0 means no such limit. A request takes
# ARGV[3] from the first and ARGV[4] from the second, both or neither. Time is the Redis
# server's, so every gateway's clock agrees. KEYS = RedisKeys.rate_limit(tenant). Returns
# {allowed (1/0), requests left, tokens left, ms until the requests bucket is full, ms until
# the tokens bucket is full, ms until this request would fit (0 when allowed; -1: never, it
# asks for more than the limit)}. A full bucket's key expires (a full bucket is no key).
RATE_LIMIT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limits = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local costs = {tonumber(ARGV[3]), tonumber(ARGV[4])}
local levels = {}
local allowed = 1
local wait = 0
for i = 1, 2 do
  local limit = limits[i]
  if limit > 0 then
    local v = redis.call('HMGET', KEYS[i], 'level', 'ts')
    local level = limit
    if v[1] then
      level = math.min(limit, tonumber(v[1]) + (now - tonumber(v[2])) * limit / 60000)
    end
    levels[i] = level
    if costs[i] > limit then
      allowed = 0
      wait = -1
    elseif level < costs[i] then
      allowed = 0
      if wait >= 0 then wait = math.max(wait, math.ceil((costs[i] - level) * 60000 / limit)) end
    end
  end
end
local out = {allowed, -1, -1, 0, 0, wait}
for i = 1, 2 do
  local limit = limits[i]
  if limit > 0 then
    local level = levels[i]
    if allowed == 1 then
      level = level - costs[i]
      local full_ms = math.ceil((limit - level) * 60000 / limit)
      if full_ms > 0 then
        redis.call('HSET', KEYS[i], 'level', tostring(level), 'ts', now)
        redis.call('PEXPIRE', KEYS[i], full_ms + 1000)
      else
        redis.call('DEL', KEYS[i])
      end
    end
    out[1 + i] = math.floor(level)
    out[3 + i] = math.ceil((limit - level) * 60000 / limit)
  end
end
return out
"""
