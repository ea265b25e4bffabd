"""One routing decision from what the index and the load table say: shared by the Ray Serve
router and `prefixgate bench router`, so the benchmark times the code that serves traffic.

The policy scores only the replicas that matter for this request: those holding its leading
blocks (sampled by the index), the session's last replica, those this router just sent the
same prefix to, and a few sampled at random for load. So its cost, like the lookup's, does not
grow with the fleet.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from router.load_table import LoadTable
from router.policy import Decision, Policy, ReplicaView, RouteRequest
from router.redis_index import Lookup


class InflightPrefixes:
    """Prompts this router sent in the last few seconds, by block hash.

    The index learns about blocks only once a replica has computed them; a second request with
    the same new system prompt arriving meanwhile would look cold everywhere and could be sent
    to compute it again elsewhere. Counting what we just routed closes that gap.
    """

    def __init__(self, ttl_s: float, max_entries: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[int, tuple[str, float]] = OrderedDict()

    def add(self, hashes: list[int], replica_id: str) -> None:
        expires = time.monotonic() + self.ttl_s
        for h in hashes:
            self._entries[h] = (replica_id, expires)
            self._entries.move_to_end(h)
        self._prune()

    def match(self, hashes: list[int]) -> dict[str, int]:
        """Leading blocks of this prompt recently routed to one replica: {replica: count}."""
        now = time.monotonic()
        owner, count = None, 0
        for h in hashes:
            entry = self._entries.get(h)
            if entry is None or entry[1] < now or (owner is not None and entry[0] != owner):
                break
            owner, count = entry[0], count + 1
        return {owner: count} if owner is not None else {}

    def _prune(self) -> None:
        now = time.monotonic()
        while self._entries:
            h, (_, expires) = next(iter(self._entries.items()))
            if expires >= now and len(self._entries) <= self.max_entries:
                break
            del self._entries[h]


@dataclass
class Routed:
    """One request's decision, kept from choose_replicas until Ray reports where it went."""

    route: RouteRequest
    decision: Decision
    ranked: list[str]  # scored replicas, cheapest first (the decision's replica first)
    matched: dict[str, int] = field(default_factory=dict)
    fleet_size: int = 0
    calls: int = 1
    created: float = field(default_factory=time.monotonic)


class Decider:
    def __init__(self, policy: Policy, loads: LoadTable, inflight: InflightPrefixes, sampled: int = 4) -> None:
        self.policy = policy
        self.loads = loads
        self.inflight = inflight
        self.sampled = sampled

    def score(self, route: RouteRequest, ids: list[str], look: Lookup, queue_len: Callable[[str], int | None]) -> Routed:
        """Decide among the replicas that matter; rank them by the policy's cost for fallbacks.
        `ids` are the live candidates, `queue_len` this router's own count of requests it sent
        to a replica (fresher than heartbeats)."""
        self.loads.watch(ids)
        live = set(ids)
        matched = {rid: e.matched_blocks for rid, e in look.replicas.items() if rid in live}
        for rid, n in self.inflight.match(route.block_hashes).items():
            if rid in live and n > matched.get(rid, 0):
                matched[rid] = n
        session_replica = look.session_replica if look.session_replica in live else None
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
        views = [self._view(rid, matched.get(rid, 0), queue_len(rid) or 0, unknown) for rid in sorted(scored)]
        decision = self.policy.decide(route, views, session_replica)
        ranked = [decision.replica_id]
        ranked += [v.replica_id for v in self.policy.rank(route, views) if v.replica_id != decision.replica_id]
        return Routed(route, decision, ranked, matched, fleet_size=len(ids))

    def _view(self, rid: str, matched: int, local_queue: int, unknown: dict[str, int]) -> ReplicaView:
        hb = self.loads.get(rid)
        if hb is None:  # no heartbeat: unknown load, never idle
            hb = unknown
        # heartbeats lag by up to half a second; this router's own in-flight count covers
        # requests it sent since
        running = hb.get("running", 0)
        return ReplicaView(
            replica_id=rid,
            matched_blocks=matched,
            running=running,
            waiting=max(hb.get("waiting", 0), local_queue - running),
            pending_prefill_tokens=hb.get("pending_prefill_tokens", 0),
            free_blocks=hb.get("free_blocks", 0),
            cached_blocks=hb.get("cached_blocks", 0),
            capacity_blocks=hb.get("capacity_blocks", 0),
        )
