"""One routing decision from what the index and the load table say: shared by the Ray Serve
router and `prefixgate bench router`, so the benchmark times the code that serves traffic.

The policy scores only the replicas that matter for this request: those holding its leading
blocks (sampled by the index), the session's last replica, those this router just sent the
same prefix to, and a few sampled at random for load. So its cost, like the lookup's, does not
grow with the fleet.

When the index does not answer, the same scoring runs on what the router knows itself (the
prefixes and sessions it routed recently, its load table): a `stale` decision, not a blind one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from msgspec.structs import replace

from router.index.redis_index import Lookup
from router.load_table import LoadTable
from router.policy import Policy, ReplicaView, RouteRequest
from router.prefill_pick import PrefillPick
from router.protocol.media import DISK, HOST
from router.protocol.messages import RouteDecision

# How long a router remembers where it sent each prefix, for `stale` decisions when Redis is
# away (the fresh path counts only INFLIGHT_TTL_S). A replica usually still holds what it was
# sent half a minute ago; when it does not, the engine just computes what it lacks.
STALE_MEMORY_S = 30.0
MAX_OWNERS = 4  # replicas remembered per block hash


class InflightPrefixes:
    """Prompts this router sent recently, by block hash.

    The index learns about blocks only once a replica has computed them; a second request with
    the same new system prompt arriving meanwhile would look cold everywhere and could be sent
    to compute it again elsewhere. Counting what we just routed (the last `ttl_s`) closes that
    gap. Entries are kept for `keep_s` (>= ttl_s): when Redis is away, what this router sent in
    that longer window is the best guess of where a prefix is cached (`Decider.degraded`).
    `clock` is the live router's monotonic clock; the simulator passes its simulated one.
    """

    def __init__(self, ttl_s: float, max_entries: int = 200_000, keep_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.ttl_s = ttl_s
        self.keep_s = max(keep_s if keep_s is not None else ttl_s, ttl_s)
        self.max_entries = max_entries
        # hash -> ((replica, routed at), ...), oldest first, at most MAX_OWNERS: a shared system
        # prompt goes to several replicas, and each still holds it
        self._entries: OrderedDict[int, tuple[tuple[str, float], ...]] = OrderedDict()

    def add(self, hashes: list[int], replica_id: str) -> None:
        now = self.clock()
        entries = self._entries
        for h in hashes:
            owners = entries.get(h)
            if owners is None:
                entries[h] = ((replica_id, now),)
                continue
            kept = tuple(o for o in owners if o[0] != replica_id)[-(MAX_OWNERS - 1):]
            entries[h] = (*kept, (replica_id, now))
            entries.move_to_end(h)
        self._prune()

    def match(self, hashes: list[int], max_age_s: float | None = None) -> dict[str, int]:
        """Leading blocks of this prompt routed to each replica within `max_age_s` (default
        `ttl_s`): {replica: count}, for every replica whose run is at least one block."""
        oldest = self.clock() - (self.ttl_s if max_age_s is None else max_age_s)
        alive: set[str] | None = None
        result: dict[str, int] = {}
        for i, h in enumerate(hashes, 1):
            owners = self._entries.get(h)
            if owners is None:
                break
            fresh = {rid for rid, routed_at in owners if routed_at >= oldest}
            alive = fresh if alive is None else alive & fresh
            if not alive:
                break
            for rid in alive:
                result[rid] = i
        return result

    def _prune(self) -> None:
        oldest = self.clock() - self.keep_s
        entries = self._entries
        while entries:
            h, owners = next(iter(entries.items()))
            if owners[-1][1] >= oldest and len(entries) <= self.max_entries:
                break
            del entries[h]


class SessionMemory:
    """Each session's last replica as this router sent it, bounded in entries and age.

    Redis holds the shared copy; this one answers when Redis does not (a lookup timed out, or
    Redis is away), so a conversation's next turn still goes where its blocks are. `clock` as
    for `InflightPrefixes`."""

    def __init__(self, ttl_s: float = 1800.0, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def remember(self, session_id: str, replica_id: str) -> None:
        self._entries[session_id] = (replica_id, self.clock())
        self._entries.move_to_end(session_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, session_id: str | None) -> str | None:
        entry = self._entries.get(session_id) if session_id else None
        if entry is None or self.clock() - entry[1] > self.ttl_s:
            return None
        return entry[0]


@dataclass
class Routed:
    """The router's bookkeeping around one request's decision, kept from choose_replicas until
    Ray reports where it went: the decision itself (the one type, sent to the replica as is)
    and what it was made from."""

    route: RouteRequest
    decision: RouteDecision
    ranked: list[str]  # scored replicas, cheapest first (the decision's replica first)
    matched: dict[str, int] = field(default_factory=dict)
    views: list[ReplicaView] = field(default_factory=list)  # what the policy scored
    session_replica: str | None = None
    fleet_size: int = 0
    prefill: PrefillPick | None = None  # the prefill half and why (a model with prefill replicas)
    calls: int = 1
    created: float = field(default_factory=time.monotonic)


class Decider:
    """Scores the replicas that matter for one request, from the index's answer (`score`) or,
    when Redis does not answer, from what this router knows locally (`degraded`)."""

    def __init__(self, policy: Policy, loads: LoadTable, inflight: InflightPrefixes, sampled: int = 4,
                 sessions: SessionMemory | None = None) -> None:
        self.policy = policy
        self.loads = loads
        self.inflight = inflight
        self.sampled = sampled
        self.sessions = sessions if sessions is not None else SessionMemory()

    def score(self, route: RouteRequest, ids: list[str], look: Lookup, queue_len: Callable[[str], int | None]) -> Routed:
        """Decide among the replicas that matter; rank them by the policy's cost for fallbacks.
        `ids` are the live candidates, `queue_len` this router's own count of requests it sent
        to a replica (fresher than heartbeats)."""
        live = self.loads.watch(ids)
        matched = {rid: e.matched_blocks for rid, e in look.replicas.items() if rid in live}
        # the index's lower-tier part of each match; kept when this router's own memory extends
        # the match (the blocks it sent there since are computed into the pool)
        tiers = {rid: e.tier_blocks for rid, e in look.replicas.items() if rid in live and e.tier_blocks}
        for rid, n in self.inflight.match(route.block_hashes).items():
            if rid in live and n > matched.get(rid, 0):
                matched[rid] = n
        session_replica = look.session_replica if look.session_replica in live else None
        return self._choose(route, ids, matched, session_replica, queue_len, tiers)

    def degraded(self, route: RouteRequest, ids: list[str], queue_len: Callable[[str], int | None]) -> Routed:
        """The index did not answer (lookup timed out, Redis away): decide from what this router
        knows itself, labelled `stale`. Prefix matches come from the prompts it routed in the
        last `inflight.keep_s`, the session's replica from its own memory of where it sent the
        previous turn, load from its load table (unknown once that is older than its max age)
        and its own in-flight counts. Routing blind would throw the cache away exactly when the
        gateway is starved (docs/fleet.md, run C)."""
        live = self.loads.watch(ids)
        matched = {rid: n for rid, n in self.inflight.match(route.block_hashes, self.inflight.keep_s).items() if rid in live}
        session_replica = self.sessions.get(route.session_id)
        if session_replica not in live:
            session_replica = None
        routed = self._choose(route, ids, matched, session_replica, queue_len)
        # no pull hint from memory alone: the source may no longer hold what we remember
        routed.decision = replace(routed.decision, reason="stale", pull=None)
        return routed

    def _choose(self, route: RouteRequest, ids: list[str], matched: dict[str, int], session_replica: str | None,
                queue_len: Callable[[str], int | None], tiers: dict[str, dict[str, int]] | None = None) -> Routed:
        scored = set(matched)
        if session_replica is not None:
            scored.add(session_replica)
        if self.policy.needs_all_replicas:
            scored.update(ids)
        else:
            scored.update(self.loads.sample(ids, self.sampled, scored))
        if not scored:
            scored.add(ids[0])
        unknown = self.loads.pessimistic()
        tiers = tiers or {}
        views = [self._view(rid, matched.get(rid, 0), queue_len(rid) or 0, unknown, tiers.get(rid), route.adapter)
                 for rid in sorted(scored)]
        decision = self.policy.decide(route, views, session_replica)
        ranked = [decision.replica_id]
        ranked += [v.replica_id for v in self.policy.rank(route, views) if v.replica_id != decision.replica_id]
        return Routed(route, decision, ranked, matched, views, session_replica, fleet_size=len(ids))

    def remember(self, routed: Routed, replica_id: str) -> None:
        """The request went to `replica_id`: the local memory a later degraded decision uses."""
        self.inflight.add(routed.route.block_hashes, replica_id)
        if routed.route.session_id:
            self.sessions.remember(routed.route.session_id, replica_id)

    def _view(self, rid: str, matched: int, local_queue: int, unknown: dict[str, int],
              tiers: dict[str, int] | None = None, adapter: str | None = None) -> ReplicaView:
        """`tiers`: the blocks of the match in each lower tier (the lookup's `tier_blocks`);
        `adapter`: the request's LoRA adapter identity, looked up in the replica's residents."""
        tiers = tiers or {}
        hb = self.loads.get(rid)
        resident, load_s = None, 0.0
        if adapter is not None and hb is not None and hb.get("lora_load_ms"):  # a LoRA replica that reads from disk
            resident, load_s = adapter in hb.get("lora_resident", "").split(), hb["lora_load_ms"] / 1000
        running = (hb or unknown).get("running", 0)
        if hb is None:
            # no heartbeat: unknown load, never idle; plus what this router sent there itself,
            # which is all that tells replicas apart when every heartbeat is unknown (Redis away)
            hb = unknown
            waiting = hb.get("waiting", 0) + local_queue
        else:
            # heartbeats lag by up to half a second; this router's own in-flight count covers
            # requests it sent since
            waiting = max(hb.get("waiting", 0), local_queue - running)
        return ReplicaView(
            replica_id=rid,
            matched_blocks=matched,
            host_blocks=tiers.get(HOST, 0),
            disk_blocks=tiers.get(DISK, 0),
            running=running,
            waiting=waiting,
            pending_prefill_tokens=hb.get("pending_prefill_tokens", 0),
            free_blocks=hb.get("free_blocks", 0),
            cached_blocks=hb.get("cached_blocks", 0),
            capacity_blocks=hb.get("capacity_blocks", 0),
            kv_pull=bool(hb.get("kv_pull", 0)),  # no heartbeat: no pull hint either
            adapter_resident=resident,
            adapter_load_s=load_s,
            context_tokens=hb.get("context_tokens", 0),
            queued_by_priority=hb.get("queued_by_priority", ""),
            step_fit=self.loads.latency.fit(rid) if hb is not unknown else None,  # no heartbeat: no prediction
        )
