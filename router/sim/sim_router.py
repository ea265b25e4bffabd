"""The live router's decision path, run in simulated time.

`SimRouter` does per request what `PrefixGateRouter` (router/ray_router.py) does in `_decide`
and `on_request_routed`: hash the prompt's leading `publish_depth` blocks, look them up in the
index (the session's replica with them), score through the live `Decider` (matched, session,
in-flight and `sampled_replicas` sampled replicas; `degraded` when the lookup fails), then
remember where the request went, commit it to the policy, mark its fresh blocks in flight and
renew the session key. A request under a LoRA adapter is hashed under the adapter's identity
and priced by its residency, or, with `lora_aware` off, as the base model's
(`PrefixGateRouter._adapter`). Only Redis is replaced: by `SimIndex` over the simulator's exact
block index and by `SimLoadTable` over its replicas, both on the simulator's clock.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from router.decider import Decider, InflightPrefixes, Routed, SessionMemory
from router.index.memory_index import InMemoryIndex
from router.policy import Policy, ReplicaView, RouteRequest
from router.sim.audit import DecisionTap
from router.sim.index import SimIndex
from router.sim.loads import SimLoadTable
from router.sim.replica import SimReplica
from router.sim.router_config import SimRouterConfig
from router.sim.workload import SimRequest


class SimClock:
    """Simulated seconds; the engine moves it, the router's memories and TTLs read it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class SimRouter:
    def __init__(self, policy: Policy, replicas: Mapping[str, SimReplica], blocks: InMemoryIndex,
                 config: SimRouterConfig, clock: SimClock, audit: bool = False) -> None:
        self.policy = policy
        self.config = config
        self.clock = clock
        self.replicas = replicas
        self.ids = list(replicas)  # the candidates, in a fixed order (Ray's list, live)
        self.index = SimIndex(blocks, clock, sample=config.lookup_sample, keep=config.lookup_keep,
                              session_ttl_s=config.session_ttl_s, seed=config.seed)
        self.loads = SimLoadTable(replicas, clock, config.load_refresh_s if config.stale_loads else None,
                                  seed=config.seed)
        self.inflight = InflightPrefixes(config.inflight_ttl_s, keep_s=config.stale_memory_s, clock=clock)
        # with the audit, the Decider calls the policy through a tap that keeps its last views
        self.tap = DecisionTap(policy) if audit else None
        self.decider = Decider(policy if self.tap is None else self.tap, self.loads, self.inflight, config.sampled_replicas,
                               SessionMemory(config.session_ttl_s, clock=clock))
        self._down = random.Random(f"{config.seed}:index-down")
        self.degraded = 0  # decisions that took the degraded path

    def queue_len(self, replica_id: str) -> int:
        return self.replicas[replica_id].queue_len()

    def view(self, replica_id: str, matched: int) -> ReplicaView:
        """The view the Decider would build for this replica now with this match (the audit's
        price of a holder the policy did not score)."""
        return self.decider._view(replica_id, matched, self.queue_len(replica_id), self.loads.pessimistic())

    def route_request(self, hashes: list[int], prompt_tokens: int, block_size: int,
                      session_id: str | None, adapter: str | None = None) -> RouteRequest:
        """The live router's RouteRequest: only the leading `publish_depth` blocks are hashed."""
        return RouteRequest(hashes[: self.config.publish_depth], prompt_tokens, block_size, session_id, adapter)

    def route_for(self, req: SimRequest, block_size: int) -> RouteRequest:
        """The RouteRequest of a simulated request: under its adapter's identity, or with
        `lora_aware` off (or no adapter) as the base model's keys with no adapter."""
        if req.adapter is None:
            return self.route_request(req.hashes, req.input_tokens, block_size, req.session_id)
        if not self.config.lora_aware:
            assert req.base_hashes is not None, "a request under an adapter carries its base keys"
            return self.route_request(req.base_hashes, req.input_tokens, block_size, req.session_id)
        return self.route_request(req.hashes, req.input_tokens, block_size, req.session_id, req.adapter)

    def decide(self, route: RouteRequest) -> Routed:
        """`PrefixGateRouter._decide` with an index that answers (or, with `index_down`, fails)."""
        self.loads.sync()
        if self.config.index_down and self._down.random() < self.config.index_down:
            self.degraded += 1
            return self.decider.degraded(route, self.ids, self.queue_len)
        look = self.index.lookup(route.block_hashes, route.session_id)
        return self.decider.score(route, self.ids, look, self.queue_len)

    def routed(self, routed: Routed, replica_id: str) -> None:
        """`PrefixGateRouter.on_request_routed`: the request went to `replica_id`."""
        self.decider.remember(routed, replica_id)
        self.policy.commit(routed.route, replica_id, routed.matched.get(replica_id, 0), routed.fleet_size)
        known = max(routed.matched.values(), default=0)
        fresh = routed.route.block_hashes[known:]
        if fresh:
            self.index.mark_inflight(fresh, replica_id, self.config.inflight_ttl_s)
        if routed.route.session_id:
            self.index.remember_session(routed.route.session_id, replica_id)
