"""PrefixGateRouter: our policies as a Ray Serve RequestRouter.

Set on the replica deployment through RequestRouterConfig, so it runs in every process that
holds a handle to the replicas (the gateway, Serve's proxies); all instances share one view
through Redis. Per request: chained block hashes of the prompt's token ids, one lookup in the
inverted index (the replicas holding the prompt's leading blocks, sampled, and the session's
last replica), load from a router-local table refreshed in the background, then the policy
scores only the matched replicas, the session's and a few sampled ones: the decision's cost
does not grow with the fleet. Redis slow or down: the same policy on what this router knows
itself (prefixes and sessions it routed recently, its load table), labelled `stale`, never a
blocked request. Without a Redis URL at all: consistent hashing on the session.

Under saturation Ray calls choose_replicas again for the same request until a replica accepts
it. The decision is cached per request, so the lookup runs once; side effects (in-flight
prefixes, session, balance tally) happen once, in on_request_routed, for the replica that
really took the request; and should_backoff is set, since every candidate was already ranked.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import OrderedDict

from msgspec.structs import replace
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from router.decider import STALE_MEMORY_S, Decider, InflightPrefixes, Routed, SessionMemory
from router.index.redis_index import IndexUnavailable, RedisConfig, RedisIndex
from router.latency_calibration import calibration
from router.load_table import LoadTable
from router.metrics import record_slo, router_metrics
from router.policy import ReplicaView, RouteRequest, make_policy
from router.prefill_pick import PrefillPick, PrefillPicker
from router.protocol.audit_log import AuditWriter
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.messages import GenerateRequest, RouteDecision
from router.protocol.redis_schema import INFLIGHT_TTL_S
from router.route_audit import decision_record
from router.router_options import RouterOptions
from router.slo_policy import SloPolicy, with_objectives

log = logging.getLogger("prefixgate.router")


# A request never routed (cancelled) is forgotten after this. Not on on_request_completed: Ray
# also calls it when a replica turns the request away, and the request is then routed again.
DECISION_TTL_S = 60.0
MAX_DECISIONS = 10_000


class PrefixGateRouter(RequestRouter):
    def initialize_state(self, **options) -> None:
        """`options`: the fields of RouterOptions (router/router_options.py), where each one's
        default is defined; an unknown one is a TypeError naming it."""
        o = self.options = RouterOptions(**options)
        self.policy = make_policy(o.policy, seed=o.seed, **o.policy_options)
        self.policy_name = self.policy.name  # canonical, as the policy names its decisions
        # requests with latency objectives: routed by headroom where the policy is an affinity
        # one, the default among them (router/slo_policy.py); any other policy ignores them. Its
        # p90 is recalibrated on what this process's gateway observes of the model's requests
        self.policy = with_objectives(self.policy, calibration(o.model_id))
        self.fallback = make_policy("session", seed=o.seed)
        self.model_id = o.model_id
        self.block_size = o.block_size
        self.depth = o.publish_depth
        self.sampled_replicas = o.sampled_replicas
        self.index = (
            RedisIndex(RedisConfig(o.redis_url, o.key_prefix, o.redis_timeout_s, session_ttl_s=o.session_ttl_s,
                                   buckets=o.index_buckets))
            if o.redis_url
            else None
        )
        self.loads = LoadTable(self.index, o.load_refresh_s, seed=o.seed) if self.index is not None else None
        # prefill replicas of their own (router/prefill_pick.py): their index, read as the decode one is
        self.prefill = None
        if self.index is not None and o.prefill_key_prefix:
            prefill_index = RedisIndex(RedisConfig(o.redis_url, o.prefill_key_prefix, o.redis_timeout_s,
                                                   buckets=o.index_buckets))
            self.prefill = PrefillPicker(prefill_index, LoadTable(prefill_index, o.load_refresh_s, seed=o.seed),
                                         o.pd_threshold_tokens)
        self._seeds: dict[tuple[str | None, str | None], int] = {}  # (tenant salt, adapter identity)
        self._background: set[asyncio.Task] = set()
        self.inflight = InflightPrefixes(INFLIGHT_TTL_S, keep_s=STALE_MEMORY_S)
        self.decider = (
            Decider(self.policy, self.loads, self.inflight, o.sampled_replicas, SessionMemory(o.session_ttl_s))
            if self.loads is not None
            else None
        )
        self._decisions: OrderedDict[str, Routed] = OrderedDict()
        self.routed = 0  # requests Ray reported as routed (on_request_routed)
        self._calibrated_at = -1  # load-table refresh the policy's copy prices were last set from
        # the live routing audit (docs/routing-audit.md): one file per router
        self.audit = (AuditWriter.for_process(o.audit_dir, "router", f"{os.getpid()}-{uuid.uuid4().hex[:6]}")
                      if o.audit_dir else None)

    def _adapter(self, req: GenerateRequest) -> str | None:
        """The identity the request's prompt is hashed and priced under (None: the base model's,
        also for every request when lora_aware is off)."""
        return req.adapter.identity if req.adapter is not None and self.options.lora_aware else None

    def _hashes(self, req: GenerateRequest) -> list[int]:
        adapter = self._adapter(req)
        seed = self._seeds.get((req.cache_salt, adapter))
        if seed is None:
            seed = self._seeds[(req.cache_salt, adapter)] = chain_seed(self.model_id, req.cache_salt, adapter)
        depth_tokens = self.depth * self.block_size
        return block_hashes(req.prompt_token_ids[:depth_tokens], self.block_size, seed)

    @staticmethod
    def _key(pending_request: PendingRequest, req: GenerateRequest) -> str:
        return pending_request.metadata.internal_request_id or req.request_id

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        req = pending_request.args[0] if pending_request.args else None
        if not isinstance(req, GenerateRequest):
            return [candidate_replicas]
        # every candidate is ranked below: if none takes the request, retrying at once is futile
        pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        key = self._key(pending_request, req)
        routed = self._decisions.get(key)
        if routed is not None and any(rid in by_id for rid in routed.ranked):
            routed.calls += 1  # Ray retries (all busy): same decision, no second lookup
            return self._ranks(routed, candidate_replicas, by_id)
        start = time.perf_counter()
        session = pending_request.metadata.session_id or req.session_id or None
        hashes = self._hashes(req)
        route = RouteRequest(hashes, len(req.prompt_token_ids), self.block_size, session, self._adapter(req),
                             objectives=req.objectives, priority=req.priority)
        self._calibrate()
        routed = await self._decide(route, by_id)
        if self.prefill is not None:
            chosen = routed.decision
            if chosen.pull is not None:  # a pull copies the prefix already
                routed.prefill = PrefillPick(None, "pull")
            else:
                routed.prefill = await self.prefill.pick(hashes, route.num_prompt_tokens,
                                                         routed.matched.get(chosen.replica_id, 0), self.block_size,
                                                         req.priority)
            if routed.prefill.source is not None:
                routed.decision = replace(chosen, prefill=routed.prefill.source)
        self._remember(key, routed)
        decision = routed.decision
        metrics = router_metrics()
        metrics.latency.observe(time.perf_counter() - start)
        metrics.decisions.labels(decision.policy, decision.reason).inc()
        metrics.matched_blocks.labels(decision.policy).inc(decision.matched_blocks)
        if route.objectives is not None and isinstance(self.policy, SloPolicy):  # cold: no prediction
            record_slo(metrics, route.objectives, decision.prediction)
        # the decision travels beside the request, as the replica call's `route` keyword:
        # whichever replica takes it (this decision's or a fallback) reads the pull hint there
        pending_request.kwargs["route"] = decision
        return self._ranks(routed, candidate_replicas, by_id)

    def _calibrate(self) -> None:
        """Price copies (affinity-pull's pulls, the affinity policies' lower-tier hits) with the
        rates the replicas measured and report in their heartbeats (median over the fleet),
        once per load-table refresh."""
        calibrate = getattr(self.policy, "calibrate", None)
        if calibrate is None or self.loads is None or self.loads.refreshes == self._calibrated_at:
            return
        self._calibrated_at = self.loads.refreshes
        calibrate(**self.loads.rates())

    @staticmethod
    def _ranks(routed: Routed, candidates: list[RunningReplica], by_id: dict[str, RunningReplica]) -> list[list[RunningReplica]]:
        """The scored replicas one rank each, cheapest first; the unscored rest last."""
        ranks = [[by_id[rid]] for rid in routed.ranked if rid in by_id]
        scored = set(routed.ranked)
        rest = [r for r in candidates if r.replica_id.unique_id not in scored]
        return ranks + [rest] if rest else ranks

    def _remember(self, key: str, routed: Routed) -> None:
        self._decisions[key] = routed
        now = time.monotonic()
        while self._decisions:
            first = next(iter(self._decisions.values()))
            if len(self._decisions) <= MAX_DECISIONS and now - first.created < DECISION_TTL_S:
                break
            self._decisions.popitem(last=False)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        """The request went to `replica_id`: record it, once, where it really went."""
        req = pending_request.args[0] if pending_request.args else None
        if not isinstance(req, GenerateRequest):
            return
        routed = self._decisions.pop(self._key(pending_request, req), None)
        if routed is None:
            return
        self.routed += 1
        rid = replica_id.unique_id
        matched = routed.matched.get(rid, 0)
        if self.decider is not None:
            self.decider.remember(routed, rid)  # in-flight prefixes and the session, router-local
        else:
            self.inflight.add(routed.route.block_hashes, rid)
        self.policy.commit(routed.route, rid, matched, routed.fleet_size)
        if self.audit is not None:
            self.audit.write(decision_record(self.policy, routed, rid, req.request_id))
        if self.index is not None:
            # other routers see it within a round trip: blocks nobody holds yet, now bound for rid
            known = max(routed.matched.values(), default=0)
            fresh = routed.route.block_hashes[known:]
            if fresh:
                self._spawn(self.index.mark_inflight(fresh, rid, int(INFLIGHT_TTL_S * 1000)))
            if routed.route.session_id:
                self._spawn(self.index.remember_session(routed.route.session_id, rid))

    async def _decide(self, route: RouteRequest, by_id: dict[str, RunningReplica]) -> Routed:
        ids = list(by_id)
        if self.index is not None:
            def queue_len(rid: str) -> int:
                # asked only for the replicas scored: a lookup in Ray's cache per candidate (a
                # ReplicaID hash and a clock read each) would cost O(fleet) per decision
                return self.replica_queue_len_cache.get(by_id[rid].replica_id) or 0

            await self.loads.include(ids)  # a new replica's load, before it is scored
            try:
                look = await self.index.lookup(route.block_hashes, None, route.session_id)
            except IndexUnavailable:
                router_metrics().index_failures.inc()
                return self.decider.degraded(route, ids, queue_len)
            return self.decider.score(route, ids, look, queue_len)
        rid = self.fallback.decide(route, [ReplicaView(rid) for rid in ids]).replica_id
        return Routed(route, RouteDecision(self.policy_name, "fallback", rid), [rid], fleet_size=len(ids))

    def _spawn(self, coro) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            coro.close()
            return
        task = loop.create_task(_quietly(coro))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _quietly(coro) -> None:
    try:
        await coro
    except IndexUnavailable:
        pass
