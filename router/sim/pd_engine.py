"""Discrete-event replay with decode steps that feel prefills, colocated or split into prefill
and decode replicas (issue 53).

`run_policy` (router/sim/engine.py) comes here when a config has roles or asks for the step
model; without either it runs as it always has. Per request:

1. The decode replica is chosen first, by the live router's decision path (`SimRouter`) over
   the decode replicas only (all replicas when colocated), as llm-d's scheduler does.
2. If the prompt's uncached part on that replica (its pool's leading run, at the decision) is
   longer than `pd_threshold_tokens`, llm-d's `prefix-based-pd-decider` rule, a prefill
   replica is chosen by the same policy over the prefill replicas (prefix hit, then load).
   Otherwise the decode replica prefills it itself, as a colocated replica does.
3. The prefill replica computes the prompt (its blocks enter its cache and its index), holds
   them, and the K/V of the prompt's blocks the decode replica lacks at that moment moves
   there in `TransferModel.pull_s(tokens)`; the blocks are then released on the prefill
   replica and enter the decode replica's cache, and the request joins its decode batch
   (first token after one step there).

Each role has its own index (a decode pick never counts a prefill replica's blocks) and its
own router and policy instance. Pull hints (`affinity-pull`) are ignored: no pulls here.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from typing import Protocol

from router.costs.adapter_memory import LoraConfig
from router.costs.service import ServiceModel
from router.costs.transfer_model import TransferModel
from router.index.memory_index import InMemoryIndex
from router.policy import Policy
from router.sim.metrics import PolicyResult, percentile, window_imbalance
from router.sim.pd_metrics import pd_stats
from router.sim.pd_replica import BOTH, DECODE, PREFILL, PdJob, PdReplica
from router.sim.router_config import SimRouterConfig
from router.sim.sim_router import SimClock, SimRouter
from router.sim.tiers import TierConfig
from router.sim.workload import WARMUP, SimRequest

_PREFILL_DONE, _TRANSFER_DONE, _DECODE = 0, 1, 2


class SimConfig(Protocol):
    """What this engine reads of router/sim/engine.py's `SimConfig` (which imports this module)."""

    replicas: int
    capacity_blocks: int
    block_size: int
    service: ServiceModel
    time_scale: float
    window_s: float
    transfer: TransferModel
    pull_holder: str
    router: SimRouterConfig
    tiers: TierConfig
    lora: LoraConfig
    prefill_replicas: int
    decode_replicas: int
    pd_threshold_tokens: int
    objectives: dict[str, tuple[float, float]]


def roles(config: SimConfig) -> list[str]:
    """Each replica's role: colocated (`both`) unless the config splits them."""
    p, d = config.prefill_replicas, config.decode_replicas
    if not p and not d:
        return [BOTH] * config.replicas
    if p < 0 or d < 1 or p + d != config.replicas:
        raise ValueError(f"a split needs prefill_replicas + decode_replicas == replicas and at least one decode "
                         f"replica, got {p} + {d} for {config.replicas}")
    return [PREFILL] * p + [DECODE] * d


def run_pd(requests: list[SimRequest], policy: Policy, prefill_policy: Policy, config: SimConfig,
           jobs_out: list[PdJob] | None = None, replicas_out: list[PdReplica] | None = None) -> PolicyResult:
    """Replay `requests`: `policy` picks decode replicas, `prefill_policy` (another instance)
    prefill replicas. `jobs_out` and `replicas_out`, if given, receive every finished request and
    the replicas (for tests and inspection)."""
    role_of = roles(config)
    bs = config.block_size
    indexes = {PREFILL: InMemoryIndex(), DECODE: InMemoryIndex()}
    reps = []
    for i, role in enumerate(role_of):
        index = indexes[PREFILL if role == PREFILL else DECODE]
        name = {BOTH: "r", PREFILL: "p", DECODE: "d"}[role]
        reps.append(PdReplica(f"{name}{i}", config.capacity_blocks, bs, config.service, index, config.transfer,
                              config.pull_holder, config.tiers, config.lora, role=role))
    decoders = {r.replica_id: r for r in reps if r.role != PREFILL}
    prefillers = {r.replica_id: r for r in reps if r.role == PREFILL}
    pos = {r.replica_id: i for i, r in enumerate(reps)}
    clock = SimClock()
    drouter = SimRouter(policy, decoders, indexes[DECODE], config.router, clock)
    prouter = SimRouter(prefill_policy, prefillers, indexes[PREFILL], config.router, clock) if prefillers else None
    span = (requests[-1].arrival / config.time_scale) if requests else 0.0
    nwin = max(int(span // config.window_s), 1)
    work = [[0.0] * config.replicas for _ in range(nwin)]
    reasons: Counter[str] = Counter()
    heap: list[tuple[float, int, int, PdReplica, PdJob | None, int]] = []
    seq = itertools.count()
    finished: list[PdJob] = []
    hit_blocks = prompt_blocks = rejected = 0
    threshold = config.pd_threshold_tokens

    def schedule(rep: PdReplica) -> None:
        if rep.next_t < math.inf:
            heapq.heappush(heap, (rep.next_t, next(seq), _DECODE, rep, None, rep.version))

    def start(rep: PdReplica, now: float) -> None:
        rep.admit_handovers(now)
        end = rep.try_start(now)
        if end is not None:
            heapq.heappush(heap, (end, next(seq), _PREFILL_DONE, rep, None, 0))
        schedule(rep)

    def done(job: PdJob) -> None:
        finished.append(job)

    def advance(until: float) -> None:
        nonlocal hit_blocks
        while heap and heap[0][0] <= until:
            now, _, kind, rep, job, version = heapq.heappop(heap)
            if kind == _PREFILL_DONE:
                job, _ = rep.prefill_done(now)
                assert isinstance(job, PdJob)
                hit_blocks += job.hit_blocks
                if job.window < nwin:
                    work[job.window][pos[rep.replica_id]] += job.uncached
                if rep.role == PREFILL:
                    dest = job.decode_rep
                    assert dest is not None
                    held = dest.held_run(job.req.hashes)
                    job.transfer_tokens = max(job.req.input_tokens - held * bs, 0)
                    job.transfer_s = config.transfer.pull_s(job.transfer_tokens)
                    heapq.heappush(heap, (now + job.transfer_s, next(seq), _TRANSFER_DONE, rep, job, 0))
                elif not math.isnan(job.done):
                    done(job)  # one output token: finished with its prefill
            elif kind == _TRANSFER_DONE:
                assert job is not None and job.decode_rep is not None
                rep.release(job)
                dest = job.decode_rep
                dest.handovers.append(job)
                start(dest, now)
            elif version != rep.version:
                continue  # the replica's rate changed since: a newer event stands for it
            else:
                for j in rep.decode_event(now, version):
                    done(j)
            start(rep, now)

    for req in requests:
        now = req.arrival / config.time_scale
        advance(now)
        if not reps[-1].fits(req):
            rejected += 1
            continue
        clock.now = now
        routed = drouter.decide(drouter.route_for(req, bs))
        reasons[routed.decision.reason] += 1
        drep = decoders[routed.decision.replica_id]
        drouter.routed(routed, drep.replica_id)
        window = int(now // config.window_s)
        local = drep.held_run(req.hashes)
        uncached = max(req.input_tokens - local * bs, 1)
        if prouter is not None and uncached > threshold:
            prouted = prouter.decide(prouter.route_for(req, bs))
            prep = prefillers[prouted.decision.replica_id]
            prouter.routed(prouted, prep.replica_id)
            ptokens = max(req.input_tokens - prep.held_run(req.hashes) * bs, 1)
            job = PdJob(req, now, ptokens, window, decode_rep=drep, handed=True)
            target = prep
        else:
            job = PdJob(req, now, uncached, window)
            target = drep
        target.enqueue(job)
        prompt_blocks += len(req.hashes)
        start(target, now)
    advance(math.inf)
    assert all(not r.queue and r.current is None and r.decoding == 0 and not r.handovers for r in reps)

    if jobs_out is not None:
        jobs_out.extend(finished)
    if replicas_out is not None:
        replicas_out.extend(reps)
    measured = [j for j in finished if j.req.kind != WARMUP]
    ttfts = [j.ttft for j in measured]
    first = next((r.arrival for r in requests if r.kind != WARMUP), 0.0) / config.time_scale
    stats = pd_stats(measured, span - first, config.objectives, config.prefill_replicas, config.decode_replicas,
                     threshold, config.transfer.kv_bytes_per_token)
    return PolicyResult(
        policy=policy.name,
        replicas=config.replicas,
        capacity_blocks=config.capacity_blocks,
        requests=len(requests),
        rejected=rejected,
        prompt_blocks=prompt_blocks,
        hit_blocks=hit_blocks,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        imbalance_p95=window_imbalance(work, 95),
        utilization=sum(r.busy_s for r in reps) / (config.replicas * span) if span else 0.0,
        reasons=dict(reasons),
        lora_aware=config.router.lora_aware,
        pd=stats,
    )
