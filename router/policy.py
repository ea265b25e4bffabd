"""Routing policies: pure functions of what the router knows at decision time.

No Redis, no Ray, no clocks: the Ray Serve router and the simulator both feed these classes the
same `ReplicaView`s, so a policy tuned in simulation is the policy that serves traffic. All
randomness goes through a `random.Random(seed)` owned by the policy, so runs are reproducible.
"""

from __future__ import annotations

import abc
import bisect
import random
from collections.abc import Container
from dataclasses import dataclass

import xxhash
from msgspec.structs import replace

from router import policy_table
from router.costs.transfer_model import TransferModel
from router.latency_model import StepFit
from router.policy_table import register_policy
from router.protocol.media import DISK, HOST
from router.protocol.messages import KvSource, RouteDecision
from router.protocol.slo import Objectives


@dataclass
class ReplicaView:
    """What a router knows about one live replica at decision time."""

    replica_id: str
    matched_blocks: int = 0  # leading blocks of THIS request that the replica holds (from the index)
    # of matched_blocks, those in its host / disk tier (copied back into the pool before the
    # prefill); the rest, the head of the match, are in its device pool
    host_blocks: int = 0
    disk_blocks: int = 0
    running: int = 0  # requests decoding/prefilling on it
    waiting: int = 0  # requests queued on it
    pending_prefill_tokens: int = 0  # prompt tokens admitted or queued but not yet computed
    free_blocks: int = 0
    cached_blocks: int = 0
    capacity_blocks: int = 0
    kv_pull: bool = True  # it exports and imports K/V: a pull may name it (false for vLLM replicas)
    # the request's LoRA adapter: True resident in its host memory, False to be read from disk
    # first (taking `adapter_load_s`, as it measured), None: no adapter, or the replica says nothing
    adapter_resident: bool | None = None
    adapter_load_s: float = 0.0
    # for requests with latency objectives (router/slo_policy.py): the tokens of its running
    # requests, and its step model (router/latency_model.py; None: cold, or no fresh heartbeat)
    context_tokens: int = 0
    step_fit: StepFit | None = None
    queued_by_priority: str = ""  # its heartbeat's breakdown of the work not started (redis_schema.queued_ahead)

    @property
    def device_blocks(self) -> int:
        """Leading blocks of the match in the device pool (lower tiers hold the match's end: a
        replica evicts a sequence's tail first)."""
        return max(self.matched_blocks - self.host_blocks - self.disk_blocks, 0)


@dataclass
class RouteRequest:
    block_hashes: list[int]  # chained hashes of the prompt's full blocks (router.protocol.hashing)
    num_prompt_tokens: int
    block_size: int
    session_id: str | None = None
    adapter: str | None = None  # the LoRA adapter's identity (router/protocol/lora.py), None: the base model
    # deepest leading-block match in a scored replica's device pool: what a pull could fetch
    # (set by pull-aware policies when they decide, read when they commit)
    fleet_matched: int = 0
    objectives: Objectives | None = None  # its latency objectives (router/slo_policy.py routes by them)
    priority: int = 0  # its scheduling priority on the replica (lower first): the work ahead of it there


# Every reason a decision (router/protocol/messages.py `RouteDecision`, what every policy here
# returns) can carry (the `x-prefixgate-route` header, the route metrics' label,
# the simulator's reason counts and its audit): a policy's own, and `stale`, which the Decider
# sets on a decision taken without the index (router/decider.py `degraded`).
# `slo`: the request's latency objectives moved it off the replica the policy would have chosen,
# or no replica was predicted to meet them (router/slo_policy.py).
REASONS = ("session", "prefix", "load", "fallback", "pull", "stale", "slo")


def _require(replicas: list[ReplicaView]) -> None:
    if not replicas:
        raise ValueError("no live replicas to route to")


def _queued(v: ReplicaView) -> int:
    return v.running + v.waiting


class Policy(abc.ABC):
    """Base class: `choose` picks one of the live replicas for a request."""

    name = "base"
    # Cache-blind baselines choose over the whole fleet (uniformly, or by global load), so the
    # live router must show them every replica; cache-aware ones need only matched + sampled.
    needs_all_replicas = False

    def __init__(self, *, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def choose(
        self,
        request: RouteRequest,
        replicas: list[ReplicaView],
        session_replica: str | None = None,
    ) -> RouteDecision:
        """Decide and record the decision at once (the simulator's path)."""
        decision = self.decide(request, replicas, session_replica)
        self.commit(request, decision.replica_id, decision.matched_blocks, len(replicas))
        return decision

    @abc.abstractmethod
    def decide(
        self,
        request: RouteRequest,
        replicas: list[ReplicaView],
        session_replica: str | None = None,
    ) -> RouteDecision:
        """Pick a replica without recording anything: a router may call it again for the same
        request, and only `commit` (once the request really went somewhere) has effects."""

    def decision(self, v: ReplicaView, reason: str) -> RouteDecision:
        """This policy's decision for replica `v` (its matched blocks as `v` shows them)."""
        return RouteDecision(self.name, reason, v.replica_id, v.matched_blocks)

    def commit(self, request: RouteRequest, replica_id: str, matched_blocks: int, fleet_size: int) -> None:
        """The request was routed to `replica_id` (the policy's pick or a fallback)."""
        return None  # a hook: stateless policies record nothing

    def cost(self, request: RouteRequest, v: ReplicaView) -> float:
        """What sending the request to `v` costs, in prefill-token equivalents: ranks fallbacks."""
        uncached = max(request.num_prompt_tokens - v.matched_blocks * request.block_size, 0)
        return uncached + v.pending_prefill_tokens + 256.0 * _queued(v)

    def costs(self, request: RouteRequest, replicas: list[ReplicaView]) -> dict[str, float]:
        """Each replica's cost as `decide` priced it (the audits record them; same views, same
        figures, no effect on the policy's state that a later decision reads)."""
        return {v.replica_id: self.cost(request, v) for v in replicas}

    def rank(self, request: RouteRequest, replicas: list[ReplicaView]) -> list[ReplicaView]:
        """Replicas from cheapest to dearest by `cost` (stable for ties)."""
        return sorted(replicas, key=lambda v: self.cost(request, v))

    def _argmin(self, replicas: list[ReplicaView], key) -> ReplicaView:
        """Replica with the smallest key; exact ties broken at random (not by list order)."""
        best_key = min(key(v) for v in replicas)
        ties = [v for v in replicas if key(v) == best_key]
        return ties[0] if len(ties) == 1 else self.rng.choice(ties)


@register_policy(summary="cache affinity under a load budget: the replica whose cache saves the most prefill, until its queue costs more")
class AffinityPolicy(Policy):
    """Cache affinity under a load budget (the default, `affinity-pull`, is this plus pulls).

    Cost model, in prefill-token equivalents (roughly proportional to the time to first token
    this request would see on the replica, with misses priced higher):

        cost(r) = miss_weight * uncached(r)                  # prefill this request pays there
                + tiers(r)                                   # lower-tier hits copied back
                + pending_prefill_tokens(r)                  # queue ahead of it
                + decode_weight * (running(r) + waiting(r))  # decode steps interleave with
                                                             # prefill chunks and slow it down
                + adapter(r)                                 # LoRA: its adapter read from disk
        uncached(r) = num_prompt_tokens - matched_blocks(r) * block_size
        tiers(r) = transfer.tier_tokens_equiv(host, host_blocks(r) * block_size)
                 + transfer.tier_tokens_equiv(disk, disk_blocks(r) * block_size)
        adapter(r) = adapter_weight * load_s(r) * prefill_tokens_per_s, where the request's adapter
                     is not resident on r (its heartbeat's `lora_resident`), else 0

    A replica that would read the request's adapter from disk first pays the read (its measured
    time, in prefill-token equivalents at the calibrated prefill rate), times `adapter_weight`:
    the read also evicts a resident adapter (least recently used), which another request then
    reads back. Adapter residency and the prefix go together (an adapter's prompts are hashed
    under its identity: docs/lora.md), so this term mostly breaks ties between replicas that hold
    neither, toward the one that holds the adapter.

    A hit in the device pool is free; one in the replica's host or disk tier costs its copy
    back into the pool (`TransferModel.tier_s`, at rates `calibrate` sets from the fleet's
    measurements), which at GPU-like rates is a small fraction of recomputing it, so a
    lower-tier hit still beats a miss and loses to a pool hit.

    A replica holding the prefix wins while its queue is shorter than the (weighted) prefill it
    saves; past that an idle replica is cheaper, so a hot prefix spreads over as many replicas
    as its load needs. miss_weight > 1 charges a miss for what it does beyond this request: the
    recomputed copy evicts someone else's blocks, and the conversation's later turns must follow
    it. With 4, a holder keeps a conversation until its queue is ~4x the prefill the cache saves;
    only real overload moves it, and the request that moves is not the one in the TTFT tail.

    Among replicas whose cost is within `balance_tolerance` x this request's prompt tokens of the
    lowest, the one that was sent the least prefill work recently wins (a decayed tally over the
    last ~balance_memory decisions per replica). Without it, cold requests go to whichever idle
    replica comes first and work piles up unevenly over a minute even though every queue looks
    short; evening out new work also evens out how fast each replica's LRU turns over. The
    tolerance is small (0.05: a twentieth of the request's prefill, under a fiftieth of what
    its miss costs at miss_weight 4): it ties replicas whose costs differ by load noise (a
    heartbeat's lag, one request more in a queue at low concurrency), and never one that holds
    a prefix worth more than that against one that does not. At 0.5 the tie-break sent
    requests off the replica the cost model preferred, holder included, for prefixes up to an
    eighth of the prompt: the audit's `balance` cause, a quarter to a third of the gap to the
    pooled oracle on the Mooncake trace (docs/simulator.md, "Routing audit").

    Matches past the publish depth: the router hashes and matches only a prompt's leading
    `publish_depth` blocks (`len(request.block_hashes)` of them when the prompt is longer), so a
    replica whose match reaches that depth may hold more of the prompt, usually all of it (the
    previous turn of a conversation). Such a match is priced as reaching `beyond_depth` of the
    way from the depth to the prompt's end (default 1: the whole prompt), in the tier the seen
    match ends in; otherwise a holder of a long prompt would be priced as saving only the
    depth, and lose to a replica that recomputes (or pulls) the rest.

    Sessions: the replica that served the previous turn is kept while its cost is within
    `session_slack` times the lowest cost plus `session_margin` x the prompt tokens plus one
    request's `decode_weight` (its load figure may still count the previous turn), so a turn
    whose blocks were evicted still lands where the next turn will look for them.

    Both margins are relative to the request's own size, so the same defaults hold for 100-token
    chats on 16-token blocks and 8k-token prompts on 512-token blocks. Defaults were tuned with
    the simulator on the Mooncake trace (docs/simulator.md) and checked on the live stack.
    """

    name = "affinity"

    def __init__(
        self,
        *,
        seed: int | None = None,
        miss_weight: float = 4.0,
        decode_weight: float = 256.0,
        session_slack: float = 1.25,
        session_margin: float = 0.25,
        balance_tolerance: float = 0.05,
        balance_memory: float = 64.0,
        beyond_depth: float = 1.0,
        adapter_weight: float = 2.0,
        transfer: TransferModel | None = None,
    ) -> None:
        super().__init__(seed=seed)
        self.transfer = transfer or TransferModel()
        self.miss_weight = miss_weight
        self.decode_weight = decode_weight
        self.session_slack = session_slack
        self.session_margin = session_margin
        self.balance_tolerance = balance_tolerance
        self.balance_memory = balance_memory
        self.beyond_depth = beyond_depth
        self.adapter_weight = adapter_weight
        self._recent: dict[str, float] = {}  # decayed prefill tokens routed, scaled by _growth
        self._growth = 1.0

    def _charge(self, replica_id: str, tokens: float, n: int) -> None:
        """Count-based exponential decay (no clock): each decision ages every replica's tally by
        1/(balance_memory * n); done lazily by growing the weight of new entries instead."""
        self._growth /= 1.0 - 1.0 / max(self.balance_memory * n, 2.0)
        if self._growth > 1e100:
            self._recent = {k: v / self._growth for k, v in self._recent.items()}
            self._growth = 1.0
        self._recent[replica_id] = self._recent.get(replica_id, 0.0) + tokens * self._growth

    def calibrate(self, **rates: float | None) -> None:
        """Price copies (pulls, lower-tier hits) with measured rates: TransferModel.calibrated's
        keywords, None keeping the current figure."""
        self.transfer = self.transfer.calibrated(**rates)

    def beyond(self, request: RouteRequest, matched_blocks: int) -> int:
        """Blocks a match is priced as reaching: `matched_blocks`, or where it reaches the end of
        the hashed prefix (publish_depth) of a prompt that goes on, `beyond_depth` of the way
        from there to the prompt's last full block."""
        hashed = len(request.block_hashes)
        full = request.num_prompt_tokens // request.block_size
        if not hashed or matched_blocks < hashed or full <= hashed:
            return matched_blocks
        return max(matched_blocks, min(hashed + round(self.beyond_depth * (full - hashed)), full))

    def own_hits(self, request: RouteRequest, v: ReplicaView) -> tuple[int, float]:
        """(leading blocks `v` serves from its own cache, the copy of those in its lower tiers
        back into the pool in prefill-token equivalents; device hits are free). The match runs
        pool, then host, then disk (a replica evicts a sequence's tail first), and a replica
        reads a tier back only where that beats recomputing (`TransferModel.tier_pays`): from
        the first tier that does not, the rest is computed. A match that reaches the publish
        depth is priced as going on (`beyond`), in the tier it ends in."""
        bs = request.block_size
        extra = self.beyond(request, v.matched_blocks) - v.matched_blocks
        device, host, disk = v.device_blocks, v.host_blocks, v.disk_blocks
        if disk:
            disk += extra
        elif host:
            host += extra
        else:
            device += extra
        usable, copy = device, 0.0
        for medium, n in ((HOST, host), (DISK, disk)):
            if n and not self.transfer.tier_pays(medium):
                break
            usable += n
            copy += self.transfer.tier_tokens_equiv(medium, n * bs)
        return usable, copy

    def prefix_cost(self, request: RouteRequest, v: ReplicaView) -> float:
        """The prompt's prefix on `v` from its own cache: misses recomputed, lower-tier hits
        copied back."""
        usable, copy = self.own_hits(request, v)
        return self.miss_weight * max(request.num_prompt_tokens - usable * request.block_size, 0) + copy

    def adapter_cost(self, request: RouteRequest, v: ReplicaView) -> float:
        """Reading the request's LoRA adapter from disk on `v` first, in prefill-token equivalents."""
        if request.adapter is None or v.adapter_resident is not False:
            return 0.0
        return self.adapter_weight * v.adapter_load_s * self.transfer.prefill_tokens_per_s

    def cost(self, request: RouteRequest, v: ReplicaView) -> float:
        return (self.prefix_cost(request, v) + v.pending_prefill_tokens + self.decode_weight * _queued(v)
                + self.adapter_cost(request, v))

    def commit(self, request, replica_id, matched_blocks, fleet_size):
        uncached = request.num_prompt_tokens - self.beyond(request, matched_blocks) * request.block_size
        self._charge(replica_id, max(uncached, 0), fleet_size)

    def _costs(self, request: RouteRequest, replicas: list[ReplicaView]) -> dict[str, float]:
        return {v.replica_id: self.cost(request, v) for v in replicas}

    def costs(self, request: RouteRequest, replicas: list[ReplicaView]) -> dict[str, float]:
        return self._costs(request, replicas) if replicas else {}

    def decide(self, request, replicas, session_replica=None):
        return self.decide_among(request, replicas, session_replica)

    def decide_among(self, request: RouteRequest, replicas: list[ReplicaView], session_replica: str | None = None,
                     allowed: Container[str] | None = None) -> RouteDecision:
        """`decide`, choosing only among the replicas in `allowed` (None: all of them), every
        replica priced as `decide` prices it: the SLO policy keeps a pull from a holder it will
        not send the request to (router/slo_policy.py)."""
        _require(replicas)
        costs = self._costs(request, replicas)
        pool = replicas if allowed is None else [v for v in replicas if v.replica_id in allowed]
        _require(pool)
        low = min(costs.values()) if allowed is None else min(costs[v.replica_id] for v in pool)
        near = [v for v in pool if costs[v.replica_id] <= low + self.balance_tolerance * request.num_prompt_tokens]
        recent = self._recent
        best = self._argmin(near, lambda r: (recent.get(r.replica_id, 0.0), costs[r.replica_id]))
        if session_replica is not None and session_replica != best.replica_id:
            home = next((v for v in pool if v.replica_id == session_replica), None)
            # + one request's decode weight: the home's load figure (a heartbeat, refreshed every
            # half second) usually still counts the session's previous turn, just finished there
            limit = self.session_slack * low + self.session_margin * request.num_prompt_tokens + self.decode_weight
            if home is not None and costs[session_replica] <= limit:
                return self.decision(home, "session")
        if session_replica == best.replica_id:
            return self.decision(best, "session")
        most = max(v.matched_blocks for v in replicas)
        least = min(v.matched_blocks for v in replicas)
        reason = "prefix" if most > least and best.matched_blocks == most else "load"
        return self.decision(best, reason)


@register_policy(summary="affinity where a replica may copy a prefix's K/V from the replica holding it instead of recomputing it (docs/kv-pull.md; the default)")
class AffinityPullPolicy(AffinityPolicy):
    """Affinity where a replica may copy a prefix's K/V from another replica; the
    default policy (router/policy_table.py DEFAULT_POLICY). Where no replica can pull (vLLM
    replicas) or no pull pays, it decides as affinity does.

    Each replica gets the cheaper of two ways to obtain the prompt's leading blocks it lacks:
      recompute: miss_weight * uncached_local                      (as affinity)
      pull:      transfer(pulled) + copy_weight * pulled + miss_weight * uncached_after_pull
    both plus affinity's `tiers` term for the replica's own lower-tier hits. `pulled` = tokens
    of the blocks between the replica's own match and the deepest match held in a scored
    replica's device pool (the source: a replica exports from its pool only, so what it holds
    only in a lower tier is never priced as pullable), offered only where moving them is
    faster than computing them (`TransferModel.pays`); transfer() is the `TransferModel`'s pull time in
    prefill-token equivalents (fixed cost + bytes / measured rate, times the measured prefill
    rate). The queue terms are affinity's, so each replica is priced with the option it would
    use, in affinity's unit (prefill-token equivalents: time to first token, misses priced
    higher): a hot replica's conversation moves to an idle one once the idle one's pull is
    cheaper than the hot one's queue, and a hit is kept local otherwise. The source may be a
    replica the router only just sent the prefix to (its in-flight memory); a pull that finds
    nothing there recomputes (replica/kv_io/kv_pull.py). `copy_weight` charges a pulled token for the duplicate it leaves (a copy
    evicts someone else's blocks, as a recomputed one does; miss_weight's reason, without its
    prefill time), which keeps conversations home while queues are short: without it the
    balance tie-break scatters them and the copies shrink the fleet's effective cache.

    Weights: miss_weight 4 (affinity's) and copy_weight 3. With the same miss price as
    affinity, every replica is priced as affinity prices it, except where a pull is cheaper
    than recomputing: a pull replaces a recompute only where its transfer costs less than the
    one weighted token per pulled token the two weights leave between them (transfer <
    (miss_weight - copy_weight) x pulled), i.e. where pulling clearly beats recomputing, and
    it moves a request off a holder only once the holder's queue outweighs copy_weight x the
    pulled tokens plus the transfer, three quarters of what affinity waits for before it
    recomputes elsewhere. So affinity-pull decides as affinity does wherever pulls do not pay,
    and better where they do. (It was miss_weight 8 and copy_weight 1: a miss twice affinity's
    price and a pull almost free moved requests to pulls that covered less than the holder
    held, and kept recomputes away from the replicas that should have taken them.)

    Rates are calibrated from live measurements (`calibrate`); the defaults are GPU-like.
    """

    name = "affinity-pull"

    def __init__(
        self,
        *,
        seed: int | None = None,
        transfer: TransferModel | None = None,
        copy_weight: float = 3.0,
        miss_weight: float = 4.0,
        **affinity_options: float,
    ) -> None:
        super().__init__(seed=seed, miss_weight=miss_weight, transfer=transfer, **affinity_options)
        self.copy_weight = copy_weight
        self._pulls: dict[str, int] = {}  # replica -> pull depth of the last _costs call
        self._source_id: str | None = None  # the pull source of the last _costs call

    @staticmethod
    def source(replicas: list[ReplicaView]) -> ReplicaView | None:
        """The deepest holder of the prompt's leading blocks in its device pool, what an export
        reads (ties: the least busy)."""
        best = max((v for v in replicas if v.kv_pull), key=lambda v: (v.device_blocks, -_queued(v)), default=None)
        return best if best is not None and best.device_blocks > 0 else None

    def option(self, request: RouteRequest, v: ReplicaView, source: ReplicaView | None) -> tuple[float, int]:
        """(prefix cost in prefill-token equivalents, pull depth or 0 for recompute) on `v`."""
        bs = request.block_size
        tokens = request.num_prompt_tokens
        recompute = self.prefix_cost(request, v)
        if source is None or source.replica_id == v.replica_id or not v.kv_pull:
            return recompute, 0
        depth = min(source.device_blocks, max(tokens - 1, 0) // bs)  # one token is always computed
        usable, copy = self.own_hits(request, v)
        if depth <= usable:
            return recompute, 0
        pulled = (depth - usable) * bs
        if not self.transfer.pays(pulled):  # slower than computing them here: never offered
            return recompute, 0
        pull = (
            copy  # its own lower-tier hits are still copied up
            + self.transfer.pull_tokens_equiv(pulled)
            + self.copy_weight * pulled
            + self.miss_weight * max(tokens - depth * bs, 0)
        )
        return (pull, depth) if pull < recompute else (recompute, 0)

    def _costs(self, request, replicas):
        source = self.source(replicas)
        request.fleet_matched = source.device_blocks if source is not None else 0
        costs: dict[str, float] = {}
        self._pulls = {}
        for v in replicas:
            prefix, depth = self.option(request, v, source)
            costs[v.replica_id] = (prefix + v.pending_prefill_tokens + self.decode_weight * _queued(v)
                                   + self.adapter_cost(request, v))
            if depth:
                self._pulls[v.replica_id] = depth
        self._source_id = source.replica_id if source is not None else None
        return costs

    def rank(self, request, replicas):
        costs = self._costs(request, replicas)
        return sorted(replicas, key=lambda v: costs[v.replica_id])

    def decide_among(self, request, replicas, session_replica=None, allowed=None):
        decision = super().decide_among(request, replicas, session_replica, allowed)
        depth = self._pulls.get(decision.replica_id, 0)
        if not depth:
            return decision
        reason = "session" if decision.reason == "session" else "pull"
        return replace(decision, reason=reason, pull=KvSource(self._source_id, depth))

    def commit(self, request, replica_id, matched_blocks, fleet_size):
        """Charge the prefill the replica will do: what neither its cache nor a pull covers."""
        bs = request.block_size
        tokens = request.num_prompt_tokens
        local = self.beyond(request, matched_blocks)
        uncached = max(tokens - local * bs, 0)
        depth = min(request.fleet_matched, max(tokens - 1, 0) // bs)
        if depth > local and self.transfer.pays((depth - local) * bs):
            uncached = max(tokens - depth * bs, 0)
        self._charge(replica_id, uncached, fleet_size)


@register_policy(summary="most matched leading blocks wins, ties by load; blind to queues")
class PrefixPolicy(Policy):
    """Most matched blocks wins, ties by load. Greedy on cache, blind to queues: it piles a hot
    prefix (and, when every prompt shares a system prompt, everything) onto one replica."""

    name = "prefix"

    def decide(self, request, replicas, session_replica=None):
        _require(replicas)
        v = self._argmin(
            replicas, lambda r: (-r.matched_blocks, r.pending_prefill_tokens, _queued(r))
        )
        reason = "prefix" if v.matched_blocks > 0 else "load"
        return self.decision(v, reason)


class HashRing:
    """Consistent hashing with virtual nodes: removing one of N replicas moves only the keys it
    owned (about 1/N), so the other replicas' caches stay warm."""

    def __init__(self, replica_ids: list[str], vnodes: int = 64) -> None:
        points = []
        for rid in set(replica_ids):
            for i in range(vnodes):
                points.append((xxhash.xxh64_intdigest(f"{rid}#{i}".encode()), rid))
        points.sort()
        self._keys = [p[0] for p in points]
        self._owners = [p[1] for p in points]

    def lookup(self, key: int) -> str:
        i = bisect.bisect_right(self._keys, key)
        return self._owners[i % len(self._owners)]


def session_key(request: RouteRequest) -> int | None:
    """Ring key: the session id, else the first block hash (same system prompt, same replica)."""
    if request.session_id is not None:
        return xxhash.xxh64_intdigest(request.session_id.encode())
    if request.block_hashes:
        return xxhash.xxh64_intdigest(request.block_hashes[0].to_bytes(8, "little", signed=False))
    return None


@register_policy(summary="consistent hashing on the session id (else the first block hash); ignores load")
class SessionPolicy(Policy):
    """Consistent hashing on the session id over the live replica ids; ignores load."""

    name = "session"

    def __init__(self, *, seed: int | None = None, vnodes: int = 64) -> None:
        super().__init__(seed=seed)
        self.vnodes = vnodes
        self._ring: HashRing | None = None
        self._ring_ids: frozenset[str] = frozenset()

    def ring(self, replica_ids: list[str]) -> HashRing:
        ids = frozenset(replica_ids)
        if self._ring is None or ids != self._ring_ids:
            self._ring, self._ring_ids = HashRing(list(ids), self.vnodes), ids
        return self._ring

    def decide(self, request, replicas, session_replica=None):
        _require(replicas)
        key = session_key(request)
        if key is None:
            v = self.rng.choice(replicas)
            return self.decision(v, "fallback")
        rid = self.ring([v.replica_id for v in replicas]).lookup(key)
        v = next(r for r in replicas if r.replica_id == rid)
        return self.decision(v, "session")


@register_policy(summary="power of two choices: two random replicas, the one with fewer requests; ignores the cache", aliases=("power-of-two",))
class PowerOfTwoPolicy(Policy):
    """Two random candidates, keep the one with fewer running+waiting requests. Ray Serve's
    default router does the same on its own queue counts (`ray-pow2`); this one is ours, so a
    served and a simulated `pow2` are the same algorithm."""

    name = "pow2"
    needs_all_replicas = True  # two drawn from the whole fleet, as the simulator draws them

    def decide(self, request, replicas, session_replica=None):
        _require(replicas)
        if len(replicas) == 1:
            v = replicas[0]
        else:
            a, b = self.rng.sample(replicas, 2)
            v = a if _queued(a) <= _queued(b) else b
        return self.decision(v, "load")

    def rank(self, request, replicas):
        """Fallbacks by queue length alone (cache-blind, like the choice)."""
        return sorted(replicas, key=_queued)


@register_policy(summary="uniform choice: the cache-blind baseline")
class RandomPolicy(Policy):
    """Uniform choice: the baseline any cache-aware policy must beat."""

    name = "random"
    needs_all_replicas = True

    def decide(self, request, replicas, session_replica=None):
        _require(replicas)
        v = self.rng.choice(replicas)
        return self.decision(v, "fallback")

    def rank(self, request, replicas):
        """Fallbacks in random order too: ranked by cached blocks, a full replica's overflow
        would follow the cache and the baseline would not be cache-blind."""
        order = list(replicas)
        self.rng.shuffle(order)
        return order


@register_policy(summary="least pending prefill, then fewest requests, over every replica; ignores the cache")
class LeastLoadedPolicy(Policy):
    """Minimum pending prefill work, then fewest requests: balances load, ignores the cache."""

    name = "least-loaded"
    needs_all_replicas = True

    def decide(self, request, replicas, session_replica=None):
        _require(replicas)
        v = self._argmin(replicas, lambda r: (r.pending_prefill_tokens, _queued(r)))
        return self.decision(v, "load")

    def rank(self, request, replicas):
        """Fallbacks by load alone (cache-blind, like the choice)."""
        return sorted(replicas, key=lambda r: (r.pending_prefill_tokens, _queued(r)))


# Ours by name, the default first, then in the order above: the registry's view, for the simulator.
POLICIES: dict[str, type[Policy]] = {e.name: e.policy_class for e in policy_table.entries(policy_table.OURS)}


def make_policy(name: str, *, seed: int | None = None, **options) -> Policy:
    """Build a policy of ours by name or alias; unknown names, and Ray's routers (which only
    Ray Serve runs), raise ValueError listing ours."""
    entry = policy_table.get(name)
    if not entry.is_ours:
        raise ValueError(f"policy {entry.name!r} is Ray Serve's router, not one of ours; ours: {', '.join(POLICIES)}")
    return entry.policy_class(seed=seed, **options)
