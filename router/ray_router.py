"""PrefixGateRouter: our policies as a Ray Serve RequestRouter.

Set on the replica deployment through RequestRouterConfig, so it runs in every process that
holds a handle to the replicas (the gateway, Serve's proxies); all instances share one view
through Redis. Per request: chained block hashes of the prompt's token ids, one scripted
Redis round trip for every live replica's leading-block match, heartbeat load and the
session's last replica, then the policy. Redis slow or down: consistent hashing on the
session over live replicas, never a blocked request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from router.metrics import router_metrics
from router.policy import Decision, ReplicaView, RouteRequest, make_policy
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.messages import GenerateRequest
from router.redis_index import IndexUnavailable, RedisConfig, RedisIndex

log = logging.getLogger("prefixgate.router")


INFLIGHT_TTL_S = 3.0  # long enough for a replica to finish the prefill and publish its blocks


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


class PrefixGateRouter(RequestRouter):
    def initialize_state(
        self,
        policy: str = "affinity",
        model_id: str = "SmolLM2-135M-Instruct",
        block_size: int = 16,
        publish_depth: int = 64,
        redis_url: str | None = None,
        key_prefix: str = "prefixgate",
        redis_timeout_s: float = 0.05,
        session_ttl_s: int = 1800,
        seed: int | None = None,
        policy_options: dict | None = None,
    ) -> None:
        self.policy_name = policy
        self.policy = make_policy(policy, seed=seed, **(policy_options or {}))
        self.fallback = make_policy("session", seed=seed)
        self.model_id = model_id
        self.block_size = block_size
        self.depth = publish_depth
        self.index = (
            RedisIndex(RedisConfig(redis_url, key_prefix, redis_timeout_s, session_ttl_s=session_ttl_s))
            if redis_url
            else None
        )
        self._seeds: dict[str | None, int] = {}
        self._background: set[asyncio.Task] = set()
        self.inflight = InflightPrefixes(INFLIGHT_TTL_S)

    def _hashes(self, req: GenerateRequest) -> list[int]:
        seed = self._seeds.get(req.cache_salt)
        if seed is None:
            seed = self._seeds[req.cache_salt] = chain_seed(self.model_id, req.cache_salt)
        depth_tokens = self.depth * self.block_size
        return block_hashes(req.prompt_token_ids[:depth_tokens], self.block_size, seed)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        req = pending_request.args[0] if pending_request.args else None
        if not isinstance(req, GenerateRequest):
            return [candidate_replicas]
        start = time.perf_counter()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        session = pending_request.metadata.session_id or req.session_id or None
        hashes = self._hashes(req)
        route = RouteRequest(hashes, len(req.prompt_token_ids), self.block_size, session)
        decision = await self._decide(route, by_id)
        self.inflight.add(hashes, decision.replica_id)
        elapsed = time.perf_counter() - start
        metrics = router_metrics()
        metrics.latency.observe(elapsed)
        metrics.decisions.labels(self.policy_name, decision.reason).inc()
        metrics.matched_blocks.labels(self.policy_name).inc(decision.matched_blocks)
        req.route = {
            "policy": self.policy_name,
            "reason": decision.reason,
            "replica": decision.replica_id,
            "matched_blocks": decision.matched_blocks,
        }
        chosen = by_id[decision.replica_id]
        rest = [r for r in candidate_replicas if r is not chosen]
        return [[chosen], rest] if rest else [[chosen]]

    async def _decide(self, route: RouteRequest, by_id: dict[str, RunningReplica]) -> Decision:
        ids = list(by_id)
        if self.index is not None:
            try:
                look = await self.index.lookup(route.block_hashes, ids, route.session_id)
            except IndexUnavailable:
                router_metrics().index_failures.inc()
            else:
                views = []
                pending = self.inflight.match(route.block_hashes)
                for rid in ids:
                    entry = look.replicas.get(rid)
                    hb = entry.heartbeat if entry else {}
                    # heartbeats lag by up to half a second; this router's own in-flight count
                    # (kept by Ray Serve) covers requests it sent since
                    local_queue = self.replica_queue_len_cache.get(by_id[rid].replica_id) or 0
                    views.append(
                        ReplicaView(
                            replica_id=rid,
                            matched_blocks=max(entry.matched_blocks if entry else 0, pending.get(rid, 0)),
                            running=hb.get("running", 0),
                            waiting=max(hb.get("waiting", 0), local_queue - hb.get("running", 0)),
                            pending_prefill_tokens=hb.get("pending_prefill_tokens", 0),
                            free_blocks=hb.get("free_blocks", 0),
                            cached_blocks=hb.get("cached_blocks", 0),
                            capacity_blocks=hb.get("capacity_blocks", 0),
                        )
                    )
                session_replica = look.session_replica if look.session_replica in by_id else None
                decision = self.policy.choose(route, views, session_replica)
                if route.session_id:
                    self._spawn(self.index.remember_session(route.session_id, decision.replica_id))
                return decision
        decision = self.fallback.choose(route, [ReplicaView(rid) for rid in ids])
        return Decision(decision.replica_id, "fallback", 0)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(_quietly(coro))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _quietly(coro) -> None:
    try:
        await coro
    except IndexUnavailable:
        pass
