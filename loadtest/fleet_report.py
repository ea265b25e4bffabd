"""Figures of one live trace replay, the simulator on the same rows, and both side by side.

Pure functions of the replayed requests and their records, so tests can check them by hand.
Time: trace seconds / `load_scale` = model seconds (what the simulator and its service model
speak); model seconds / `wall_scale` = wall seconds (what the live run takes). Live TTFTs are
converted back to model seconds, so live and simulated columns read in the same unit.
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from dataclasses import asdict, dataclass, field

from router import registry
from router.costs.adapter_memory import LoraConfig
from router.costs.service import ServiceModel
from router.policy import make_policy
from router.sim.cli import make_transfer
from router.sim.engine import SimConfig, run_policy
from router.sim.metrics import percentile, window_imbalance
from router.sim.oracle import pooled_lru_hits, unbounded_hits
from router.sim.router_config import SimRouterConfig
from router.sim.tiers import TierConfig
from router.sim.trace import scale_service, scale_transfer
from router.sim.workload import SimRequest


@dataclass
class RunSettings:
    """What a live replay and its simulated twin share."""

    replicas: int
    capacity_blocks: int
    block_size: int = 16
    load_scale: float = 1.0  # trace arrivals sped up by this (the simulator's --time-scale)
    wall_scale: float = 1.0  # model time sped up by this in wall time (< 1: slower, lower lag)
    window_s: float = 60.0  # imbalance window, model seconds
    seed: int = 0
    tiers: TierConfig = field(default_factory=TierConfig)  # each replica's host and disk tiers
    transfer: dict[str, float] = field(default_factory=dict)  # TransferModel overrides (tier rates)
    lora: LoraConfig = field(default_factory=LoraConfig)  # each replica's adapters in host memory
    lora_aware: bool = True  # the router hashes and prices adapters


@dataclass
class FleetResult:
    """One policy, live or simulated; fields missing on one side stay None."""

    source: str  # live | sim
    policy: str
    replicas: int
    requests: int
    errors: int
    prompt_blocks: int
    hit_blocks: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    imbalance_p95: float | None
    request_share_max: float | None = None  # busiest replica's share of requests (1/N is even)
    prefill_share_max: float | None = None  # busiest replica's share of computed prompt tokens
    reasons: dict[str, int] = field(default_factory=dict)
    error_kinds: dict[str, int] = field(default_factory=dict)
    oracle_pooled: float = math.nan
    oracle_unbounded: float = math.nan
    step_lag: float | None = None  # live: worst replica's (actual - modelled) / modelled step time
    send_lag_p99_s: float | None = None  # live: how late the client sent (wall seconds)
    decision_p50_s: float | None = None
    decision_p99_s: float | None = None
    utilization: float | None = None  # sim: modelled prefill busy fraction
    valid: bool = True

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def hit_vs_pooled(self) -> float:
        return self.hit_rate / self.oracle_pooled if self.oracle_pooled else math.nan

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["hit_vs_pooled"] = self.hit_vs_pooled
        return d


def oracles(requests: list[SimRequest], s: RunSettings) -> tuple[float, float]:
    """(pooled-LRU, unbounded) hit rates over the same prompt blocks; the pooled LRU holds every
    replica's pool and tiers together."""
    total = sum(len(r.hashes) for r in requests)
    if not total:
        return math.nan, math.nan
    pooled = pooled_lru_hits(requests, (s.capacity_blocks + s.tiers.blocks) * s.replicas)
    return pooled / total, unbounded_hits(requests) / total


def _error_kind(err: str) -> str:
    return err.split(":", 1)[0][:40]


def live_result(policy: str, requests: list[SimRequest], records: list[dict], s: RunSettings,
                replica_ids: list[str] | None = None) -> FleetResult:
    """Figures of a live replay. `records[i]` answers `requests[i]` (ReplayRecord dicts)."""
    if len(records) != len(requests):
        raise ValueError(f"{len(records)} records for {len(requests)} requests")
    ok = [(q, r) for q, r in zip(requests, records, strict=True) if r.get("ok")]
    bad = [r for r in records if not r.get("ok")]
    prompt_blocks = sum(len(q.hashes) for q, _ in ok)
    cached = sum(r["cached_tokens"] for _, r in ok)
    ttfts = [r["ttft_s"] * s.wall_scale for _, r in ok if r.get("ttft_s") is not None]
    ids = sorted(set(replica_ids or []) | {r["replica"] for _, r in ok if r.get("replica")})
    n = max(len(ids), s.replicas)
    pos = {rid: i for i, rid in enumerate(ids)}
    last = max((q.arrival for q in requests), default=0.0) / s.load_scale
    nwin = max(int(last // s.window_s), 1)
    work = [[0.0] * n for _ in range(nwin)]
    per_req: Counter[str] = Counter()
    per_prefill: Counter[str] = Counter()
    for q, r in ok:
        rid = r.get("replica") or "unknown"
        uncached = max(r["prompt_tokens"] - r["cached_tokens"], 0)
        per_req[rid] += 1
        per_prefill[rid] += uncached
        w = int(q.arrival / s.load_scale // s.window_s)
        if w < nwin and rid in pos:
            work[w][pos[rid]] += uncached
    pooled, unbounded = oracles(requests, s)
    total_prefill = sum(per_prefill.values())
    lags = [r.get("send_lag_s") or 0.0 for r in records]
    return FleetResult(
        source="live", policy=policy, replicas=s.replicas, requests=len(requests), errors=len(bad),
        prompt_blocks=prompt_blocks, hit_blocks=cached / s.block_size,
        ttft_p50_s=percentile(ttfts, 50) if ttfts else None,
        ttft_p99_s=percentile(ttfts, 99) if ttfts else None,
        imbalance_p95=window_imbalance(work, 95),
        request_share_max=max(per_req.values()) / len(ok) if ok else None,
        prefill_share_max=max(per_prefill.values()) / total_prefill if total_prefill else None,
        reasons=dict(Counter(r.get("route") or "none" for _, r in ok)),
        error_kinds=dict(Counter(_error_kind(r.get("error") or "?") for r in bad)),
        oracle_pooled=pooled, oracle_unbounded=unbounded,
        send_lag_p99_s=percentile(lags, 99) if lags else None,
    )


def sim_result(policy: str, requests: list[SimRequest], s: RunSettings,
               service: ServiceModel | None = None, options: dict[str, float] | None = None) -> FleetResult:
    """The simulator on the same rows: same block size, capacity, load scale and service model
    (the trace's, converted to the block size), exact and instantaneous router state.
    `options`: the policy's constructor arguments (e.g. affinity's miss_weight), for sweeps."""
    service = service or ServiceModel()
    transfer = scale_transfer(make_transfer(service, s.transfer), s.block_size)
    config = SimConfig(replicas=s.replicas, capacity_blocks=s.capacity_blocks, block_size=s.block_size,
                       service=scale_service(service, s.block_size),
                       time_scale=s.load_scale, window_s=s.window_s, transfer=transfer, tiers=s.tiers,
                       lora=s.lora, router=SimRouterConfig(lora_aware=s.lora_aware))
    name = registry.sim_policy(policy)  # Ray's routers are approximated by ours (docs/policies.md)
    extra = {"transfer": transfer} if "transfer" in inspect.signature(registry.get(name).policy_class).parameters else {}
    r = run_policy(requests, make_policy(name, seed=s.seed, **extra, **(options or {})), config)
    pooled, unbounded = oracles(requests, s)
    return FleetResult(
        source="sim", policy=policy, replicas=s.replicas, requests=r.requests, errors=r.rejected,
        prompt_blocks=r.prompt_blocks, hit_blocks=r.hit_blocks + r.pulled_blocks, ttft_p50_s=r.ttft_p50_s,
        ttft_p99_s=r.ttft_p99_s, imbalance_p95=r.imbalance_p95, reasons=r.reasons,
        utilization=r.utilization, oracle_pooled=pooled, oracle_unbounded=unbounded,
    )


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def format_side_by_side(pairs: list[tuple[FleetResult, FleetResult | None]]) -> str:
    """One line per (live, sim) result: hit rates, the gap in points, TTFTs, balance, errors."""
    head = (f"{'replicas':>8} {'policy':<13}{'live hit':>9}{'sim hit':>9}{'gap':>7}{'/pooled':>9}"
            f"{'ttft50 live/sim':>18}{'ttft99 live/sim':>18}{'imbal live/sim':>16}{'req max':>8}"
            f"{'err':>5}{'lag':>7}{'route p50/p99 ms':>18}  reasons")
    lines = [head]
    for live, sim in pairs:
        gap = (live.hit_rate - sim.hit_rate) * 100 if sim else None
        reasons = " ".join(f"{k}={v}" for k, v in sorted(live.reasons.items()))
        lines.append(
            f"{live.replicas:>8} {live.policy:<13}{live.hit_rate:>9.1%}{_f(sim and sim.hit_rate, '{:.1%}'):>9}"
            f"{_f(gap, '{:+.1f}'):>7}{_f(live.hit_vs_pooled, '{:.1%}'):>9}"
            f"{_f(live.ttft_p50_s, '{:.2f}') + '/' + _f(sim and sim.ttft_p50_s, '{:.2f}s'):>18}"
            f"{_f(live.ttft_p99_s, '{:.2f}') + '/' + _f(sim and sim.ttft_p99_s, '{:.2f}s'):>18}"
            f"{_f(live.imbalance_p95, '{:.2f}') + '/' + _f(sim and sim.imbalance_p95, '{:.2f}'):>16}"
            f"{_f(live.request_share_max, '{:.0%}'):>8}{live.errors:>5}{_f(live.step_lag, '{:.0%}'):>7}"
            f"{_f(live.decision_p50_s and live.decision_p50_s * 1e3, '{:.2f}') + '/' + _f(live.decision_p99_s and live.decision_p99_s * 1e3, '{:.2f}'):>18}"
            f"  {reasons}{'' if live.valid else '  INVALID (step lag > 10% or routers starved)'}"
        )
    return "\n".join(lines)
