"""Discrete-event replay of a request stream through simulated replicas and a policy.

Events: arrivals (from the sorted trace), prefill completions and request completions (from a
heap). Each arrival is routed by the live router's decision path (`SimRouter`: the Decider,
the in-flight and session memories, `sampled_replicas`, the policy's commit) over an index and
a load table that read the simulated replicas at that instant (router/sim/sim_router.py).
Requests under LoRA adapters are hashed and priced as the live router does (`lora_aware`), and
a replica reads an adapter it does not hold before the prefill (router/sim/lora.py).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from copy import deepcopy
from dataclasses import dataclass, field

from router.costs.adapter_memory import LoraConfig
from router.costs.service import ServiceModel
from router.costs.transfer_model import TransferModel
from router.index.memory_index import InMemoryIndex
from router.policy import Policy
from router.protocol.media import DISK, HOST
from router.sim.audit import RoutingAudit
from router.sim.metrics import PolicyResult, percentile, window_imbalance
from router.sim.pd_engine import run_pd
from router.sim.replica import Job, SimReplica
from router.sim.router_config import SimRouterConfig
from router.sim.sim_router import SimClock, SimRouter
from router.sim.tiers import TierConfig
from router.sim.workload import SimRequest

PD_THRESHOLD_TOKENS = 512  # llm-d's prefix-based-pd-decider default: uncached tokens that pay a hand-over
_PREFILL_DONE = 0
_FINISH = 1


@dataclass
class SimConfig:
    replicas: int
    capacity_blocks: int
    block_size: int = 512
    service: ServiceModel = field(default_factory=ServiceModel)
    time_scale: float = 1.0  # arrivals happen this many times faster than in the trace
    window_s: float = 60.0  # imbalance window, in simulated (scaled) seconds
    transfer: TransferModel = field(default_factory=TransferModel)  # K/V pulls between replicas
    pull_holder: str = "keep"  # what a pull does to the holder's LRU: keep | touch | demote (SimReplica)
    router: SimRouterConfig = field(default_factory=SimRouterConfig)  # the live router's options
    tiers: TierConfig = field(default_factory=TierConfig)  # each replica's host and disk tiers
    lora: LoraConfig = field(default_factory=LoraConfig)  # each replica's LoRA adapters in host memory
    # prefill/decode split (router/sim/pd_engine.py): 0/0 is colocated, as always; a split needs
    # prefill_replicas + decode_replicas == replicas
    prefill_replicas: int = 0
    decode_replicas: int = 0
    pd_threshold_tokens: int = PD_THRESHOLD_TOKENS  # hand over only prompts with more uncached on the decode replica
    step_model: bool = False  # decode steps stretched by prefills on their replica (always, with a split)
    objectives: dict[str, tuple[float, float]] = field(default_factory=dict)  # class -> (TTFT s, TPOT s): goodput


def run_policy(requests: list[SimRequest], policy: Policy, config: SimConfig,
               audit: RoutingAudit | None = None) -> PolicyResult:
    """Replay `requests` under `policy`. With `audit`, every decision is also recorded there
    (router/sim/audit.py; `audit.summarize` after the run); without it nothing is. A config
    with roles or the step model runs in router/sim/pd_engine.py (no audit there)."""
    if config.prefill_replicas or config.decode_replicas or config.step_model:
        if audit is not None:
            raise ValueError("the routing audit does not cover prefill/decode runs")
        # the prefill replicas' own instance of the policy, in its state before the run
        return run_pd(requests, policy, deepcopy(policy), config)
    index = InMemoryIndex()
    reps = [
        SimReplica(f"r{i}", config.capacity_blocks, config.block_size, config.service, index, config.transfer,
                   config.pull_holder, config.tiers, config.lora)
        for i in range(config.replicas)
    ]
    by_id = {r.replica_id: r for r in reps}
    pos = {r.replica_id: i for i, r in enumerate(reps)}
    clock = SimClock()
    router = SimRouter(policy, by_id, index, config.router, clock, audit=audit is not None)
    span = (requests[-1].arrival / config.time_scale) if requests else 0.0
    # whole windows only: a trailing partial window holds fewer requests and reads noisier
    nwin = max(int(span // config.window_s), 1)
    work = [[0.0] * config.replicas for _ in range(nwin)]
    reasons: Counter[str] = Counter()
    heap: list[tuple[float, int, int, SimReplica, Job | None]] = []
    seq = itertools.count()
    ttfts: list[float] = []
    pull_times: list[float] = []
    tier_times: list[float] = []
    promoted: Counter[str] = Counter()  # hit blocks copied back from each lower tier
    hit_blocks = pulled_blocks = prompt_blocks = rejected = 0
    adapter_requests = adapter_loads = 0

    def start(rep: SimReplica, now: float) -> None:
        end = rep.try_start(now)
        if end is not None:
            heapq.heappush(heap, (end, next(seq), _PREFILL_DONE, rep, None))

    def advance(until: float) -> None:
        nonlocal hit_blocks, pulled_blocks, adapter_requests, adapter_loads
        while heap and heap[0][0] <= until:
            now, _, kind, rep, job = heapq.heappop(heap)
            if kind == _PREFILL_DONE:
                job, end = rep.prefill_done(now)
                ttfts.append(job.ttft)
                hit_blocks += job.hit_blocks
                if job.req.adapter is not None:
                    adapter_requests += 1
                    adapter_loads += job.adapter_read
                if job.promoted:
                    promoted.update(job.promoted)
                    tier_times.append(job.tier_s)
                if job.pulled_blocks:
                    pulled_blocks += job.pulled_blocks
                    pull_times.append(job.pull_s)
                if job.window < nwin:
                    work[job.window][pos[rep.replica_id]] += job.uncached
                heapq.heappush(heap, (end, next(seq), _FINISH, rep, job))
                if audit is not None:
                    audit.admitted(job)
            else:
                rep.finish(job)
            start(rep, now)

    bs = config.block_size
    for i, req in enumerate(requests):
        now = req.arrival / config.time_scale
        advance(now)
        if not reps[0].fits(req):
            rejected += 1
            if audit is not None:
                audit.rejected(i, req, now)
            continue
        clock.now = now
        routed = router.decide(router.route_for(req, bs))
        decision = routed.decision
        reasons[decision.reason] += 1
        if audit is not None:  # before the commit and the enqueue: the state the decision saw
            record = audit.decided(i, req, now, routed, router.tap, reps, router)
        rep = by_id[decision.replica_id]  # its queue is unbounded: the first choice always takes it
        router.routed(routed, rep.replica_id)
        held = index.match_media(req.hashes, [rep.replica_id])[rep.replica_id]  # what it really holds
        local = held.matched_blocks
        copy = round(rep.copy_tokens(held.tier_blocks))  # bringing its lower-tier part back
        copy += round(rep.adapter_tokens(req.adapter))  # and reading its adapter from disk
        job = Job(req, now, 0, int(now // config.window_s))
        source, depth = None, 0
        pull = decision.pull
        if pull is not None and pull.num_blocks > local:
            # the pull reads the source at the request's arrival, as a live replica pulls before
            # the request queues for its engine
            source = by_id[pull.replica_id]
            depth = source.export_run(req.hashes, pull.num_blocks, local, rep.pull_holder)
        if source is not None and depth > local:
            job.pull_from, job.pull_depth = source, depth
            pull_tokens = (depth - local) * bs
            # queued work as the policy sees it: the prefill left plus the pull's time
            job.est_uncached = max(req.input_tokens - depth * bs, 1) + copy + round(
                config.transfer.pull_tokens_equiv(pull_tokens))
        else:
            job.est_uncached = max(req.input_tokens - local * bs, 1) + copy
        rep.enqueue(job)
        if audit is not None:
            audit.enqueued(job, record)
        prompt_blocks += len(req.hashes)
        start(rep, now)
    advance(math.inf)
    assert all(not r.queue and r.current is None and r.decoding == 0 for r in reps)

    return PolicyResult(
        policy=policy.name,
        replicas=config.replicas,
        capacity_blocks=config.capacity_blocks,
        requests=len(requests),
        rejected=rejected,
        prompt_blocks=prompt_blocks,
        hit_blocks=hit_blocks,
        host_hit_blocks=promoted[HOST],
        disk_hit_blocks=promoted[DISK],
        tier_bytes=promoted.total() * bs * config.transfer.kv_bytes_per_token,
        tier_p99_s=percentile(tier_times, 99),
        pulled_blocks=pulled_blocks,
        pull_bytes=pulled_blocks * bs * config.transfer.kv_bytes_per_token,
        pull_p50_s=percentile(pull_times, 50),
        pull_p99_s=percentile(pull_times, 99),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        imbalance_p95=window_imbalance(work, 95),
        utilization=sum(r.busy_s for r in reps) / (config.replicas * span) if span else 0.0,
        reasons=dict(reasons),
        adapter_requests=adapter_requests,
        adapter_loads=adapter_loads,
        lora_aware=config.router.lora_aware,
    )
