"""Figures reported per policy, and the small statistics they need."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; nan when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def window_imbalance(work: list[list[float]], q: float = 95.0) -> float:
    """Percentile over windows of max/mean work per replica (idle windows skipped).

    `work[w][r]` is the prefill work routed to replica r by requests arriving in window w;
    1.0 is perfect balance, N means one replica got everything."""
    ratios = []
    for row in work:
        total = sum(row)
        if total > 0:
            ratios.append(max(row) * len(row) / total)
    return percentile(ratios, q)


@dataclass
class PdStats:
    prefill_replicas: int
    decode_replicas: int
    threshold_tokens: int
    measured: int  # requests the figures are over (warm-up excluded)
    handed_over: int  # of those, prefilled on a prefill replica and handed over
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    transfer_mean_s: float  # modelled K/V transfer time per handed-over request
    transfer_p99_s: float
    transfer_mb_per_request: float  # K/V moved per measured request (all of them)
    goodput_rps: float = math.nan  # requests meeting both objectives per second (nan: no objectives)
    attainment: float = math.nan  # share of the judged requests meeting both
    classes: dict[str, dict[str, float]] = field(default_factory=dict)  # per class: n, ttft/tpot p99, attainment

    @property
    def handed_share(self) -> float:
        return self.handed_over / self.measured if self.measured else 0.0


@dataclass
class PolicyResult:
    policy: str
    replicas: int
    capacity_blocks: int
    requests: int
    rejected: int  # prompts larger than a replica's pool
    prompt_blocks: int
    hit_blocks: int  # served from the replica's own cache, in any tier
    ttft_p50_s: float
    ttft_p99_s: float
    imbalance_p95: float
    utilization: float  # mean prefill busy fraction over the arrival span
    reasons: dict[str, int] = field(default_factory=dict)
    hit_vs_pooled: float = math.nan
    pulled_blocks: int = 0  # copied from another replica's cache instead of computed
    pull_bytes: float = 0.0  # K/V bytes moved by those pulls (the transfer model's bytes/token)
    pull_p50_s: float = math.nan  # modelled transfer time per pulling request
    pull_p99_s: float = math.nan
    host_hit_blocks: int = 0  # of hit_blocks, copied back from the host tier ...
    disk_hit_blocks: int = 0  # ... and from the disk tier (the rest were in the device pool)
    tier_bytes: float = 0.0  # K/V bytes those copies moved
    tier_p99_s: float = math.nan  # modelled copy time per request with a tier hit
    audit: dict | None = None  # with --audit: the gap to the ceilings by cause (router/sim/audit.py)
    adapter_requests: int = 0  # served under a LoRA adapter
    adapter_loads: int = 0  # of those, the ones whose replica read the adapter from disk first
    lora_aware: bool = True  # the router hashed and priced adapters (False: the blind baseline)
    pd: PdStats | None = None  # step model or prefill/decode split: TPOT, hand-overs, goodput (router/sim/pd_metrics.py)

    @property
    def hit_rate(self) -> float:
        """Blocks not computed: local hits (device, host, disk) plus pulled blocks (what the
        fleet's cache saved)."""
        return (self.hit_blocks + self.pulled_blocks) / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def local_hit_rate(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    def share(self, blocks: int) -> float:
        return blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def tier_shares(self) -> dict[str, float]:
        """hit_rate split by where the blocks came from: they add up to it."""
        device = self.hit_blocks - self.host_hit_blocks - self.disk_hit_blocks
        return {"device": self.share(device), "host": self.share(self.host_hit_blocks),
                "disk": self.share(self.disk_hit_blocks), "pulled": self.share(self.pulled_blocks)}

    @property
    def bytes_per_request(self) -> float:
        served = self.requests - self.rejected
        return self.pull_bytes / served if served else 0.0

    @property
    def loads_per_request(self) -> float:
        """Adapter disk reads per request served."""
        served = self.requests - self.rejected
        return self.adapter_loads / served if served else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.adapter_requests:
            d["adapter_loads_per_request"] = self.loads_per_request
        else:  # a run without adapters writes what it wrote before they were modelled
            for key in ("adapter_requests", "adapter_loads", "lora_aware"):
                del d[key]
        if self.pd is None:  # a colocated run writes what it wrote before roles were modelled
            del d["pd"]
        else:
            d["pd"]["handed_share"] = self.pd.handed_share
        d["hit_rate"] = self.hit_rate
        d["local_hit_rate"] = self.local_hit_rate
        d |= {f"{where}_hit_rate": v for where, v in self.tier_shares.items()}
        d["pull_bytes_per_request"] = self.bytes_per_request
        return d
