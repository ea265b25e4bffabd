"""What moving a prefix's K/V costs, between replicas or up from a replica's lower tiers, and
how the router learns it.

A pull of `t` tokens' K/V takes `fixed_s + t * kv_bytes_per_token / bytes_per_s`; recomputing
them takes `t / prefill_tokens_per_s`; bringing them back into the device pool from the
replica's host or disk tier takes `t * kv_bytes_per_token / host_bytes_per_s` (or
`disk_bytes_per_s`), and a hit in the pool itself costs nothing. Pulling pays while the
per-token transfer time is below the per-token prefill time, i.e. while
`bytes_per_s > kv_bytes_per_token * prefill_tokens_per_s` (2.29 GB/s for the defaults below),
and for prefixes long enough to amortise `fixed_s`.

Defaults are GPU-like, not this CPU's: a 70B-class model with grouped-query attention
(80 layers x 2 x 8 KV heads x 128 x 2 bytes = 320 KB per token), 25 GB/s between replicas
(a 200 Gb/s NIC class link, or NVLink through a copy engine), 7k prompt tokens/s of prefill
(the simulator's service model, router/costs/service.py), a host tier over PCIe (25 GB/s: pinned
host memory to the GPU over PCIe 4.0 x16; 5.0 doubles it) and a disk tier on local NVMe
(4 GB/s: one PCIe 4.0 drive's sequential read).

Live, the rates are measured, not assumed: each replica keeps a moving average of the bytes/s
its pulls achieved and the prompt tokens/s its prefills achieved (replica/kv_io/kv_pull.py), and
of its copies from each tier back into the pool (replica/kvcache/kv_tiers.py), and reports them, with
its K/V bytes per token, in its heartbeat; the router folds the fleet's
reports (`fleet_rate`) into the model the policy prices with (`TransferModel.calibrated`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from router.protocol.media import DEVICE, DISK, HOST

KV_BYTES_70B = 320_000  # K/V bytes per token of a 70B-class GQA model in bf16
GPU_LINK_BYTES_S = 25e9  # between two GPU replicas
GPU_PREFILL_S_PER_TOKEN = 1.4e-4  # prefill of a 70B-class model on one GPU replica (the simulator's ServiceModel)
GPU_PREFILL_TOKENS_S = 1.0 / GPU_PREFILL_S_PER_TOKEN  # ~7.1k tokens/s
PCIE_HOST_BYTES_S = 25e9  # host tier -> GPU pool over PCIe
NVME_DISK_BYTES_S = 4e9  # disk tier (local NVMe) -> GPU pool


@dataclass(frozen=True)
class TransferModel:
    """Cost of pulling K/V, of bringing it back from a lower tier, and of recomputing it, in
    seconds."""

    kv_bytes_per_token: float = KV_BYTES_70B
    bytes_per_s: float = GPU_LINK_BYTES_S
    fixed_s: float = 0.002  # per pull: the request to the holder, pinning, the first byte
    prefill_tokens_per_s: float = GPU_PREFILL_TOKENS_S
    host_bytes_per_s: float = PCIE_HOST_BYTES_S  # host tier -> device pool
    disk_bytes_per_s: float = NVME_DISK_BYTES_S  # disk tier -> device pool

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "bytes_per_s", "prefill_tokens_per_s", "host_bytes_per_s", "disk_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.fixed_s < 0:
            raise ValueError(f"fixed_s must be >= 0, got {self.fixed_s!r}")

    def pull_bytes(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token

    def pull_s(self, tokens: int) -> float:
        """Time to move `tokens` tokens' K/V from a holder (0 for nothing to move)."""
        if tokens <= 0:
            return 0.0
        return self.fixed_s + self.pull_bytes(tokens) / self.bytes_per_s

    def prefill_s(self, tokens: int) -> float:
        return max(tokens, 0) / self.prefill_tokens_per_s

    def pull_tokens_equiv(self, tokens: int) -> float:
        """A pull's time expressed in prompt tokens of prefill (the policy's cost unit)."""
        return self.pull_s(tokens) * self.prefill_tokens_per_s

    def tier_s(self, medium: str, tokens: int) -> float:
        """Time to bring `tokens` tokens' K/V from `medium` back into the device pool (a hit in
        the pool itself: 0)."""
        if medium == DEVICE or tokens <= 0:
            return 0.0
        rate = {HOST: self.host_bytes_per_s, DISK: self.disk_bytes_per_s}[medium]
        return self.pull_bytes(tokens) / rate

    def tier_tokens_equiv(self, medium: str, tokens: int) -> float:
        """A lower-tier hit's copy time in prompt tokens of prefill (the policy's cost unit)."""
        return self.tier_s(medium, tokens) * self.prefill_tokens_per_s

    def tier_pays(self, medium: str) -> bool:
        """Copying a block back from `medium` is faster than recomputing it (a replica promotes
        from a tier only then, and the router prices the tier's hits only then)."""
        return self.tier_s(medium, 1) < self.prefill_s(1)

    def pays(self, tokens: int) -> bool:
        """Pulling `tokens` tokens is faster than recomputing them."""
        return tokens > 0 and self.pull_s(tokens) < self.prefill_s(tokens)

    def breakeven_bytes_per_s(self) -> float:
        """The link speed below which no pull, however long, beats recomputing."""
        return self.kv_bytes_per_token * self.prefill_tokens_per_s

    def calibrated(
        self,
        bytes_per_s: float | None = None,
        prefill_tokens_per_s: float | None = None,
        kv_bytes_per_token: float | None = None,
        host_bytes_per_s: float | None = None,
        disk_bytes_per_s: float | None = None,
    ) -> TransferModel:
        """The same model with measured figures substituted (None or <= 0: keep the current).

        A measured `bytes_per_s` is end to end (a pull's bytes over its whole time, the call to
        the holder included), so it already carries the fixed cost: `fixed_s` drops to 0 rather
        than being charged twice."""
        changes: dict[str, float] = {}
        if bytes_per_s is not None and bytes_per_s > 0:
            changes["fixed_s"] = 0.0
        for name, value in (
            ("bytes_per_s", bytes_per_s),
            ("prefill_tokens_per_s", prefill_tokens_per_s),
            ("kv_bytes_per_token", kv_bytes_per_token),
            ("host_bytes_per_s", host_bytes_per_s),
            ("disk_bytes_per_s", disk_bytes_per_s),
        ):
            if value is not None and value > 0:
                changes[name] = float(value)
        return replace(self, **changes) if changes else self


def fleet_rate(reports: list[float | int | None]) -> float | None:
    """One figure from the replicas' reported rates: the median of those that measured one
    (0 or missing means not measured yet), so one slow or odd replica does not set the price."""
    values = [float(v) for v in reports if v is not None and v > 0]
    return statistics.median(values) if values else None
