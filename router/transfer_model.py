"""What moving a prefix's K/V between replicas costs, and how the router learns it.

A pull of `t` tokens' K/V takes `fixed_s + t * kv_bytes_per_token / bytes_per_s`; recomputing
them takes `t / prefill_tokens_per_s`. Pulling pays while the per-token transfer time is below
the per-token prefill time, i.e. while `bytes_per_s > kv_bytes_per_token * prefill_tokens_per_s`
(2.24 GB/s for the defaults below), and for prefixes long enough to amortise `fixed_s`.

Defaults are GPU-like, not this CPU's: a 70B-class model with grouped-query attention
(80 layers x 2 x 8 KV heads x 128 x 2 bytes = 320 KB per token), 25 GB/s between replicas
(a 200 Gb/s NIC class link, or NVLink through a copy engine), 7k prompt tokens/s of prefill
(the simulator's service model, router/sim/service.py).

Live, the rates are measured, not assumed: each replica keeps an EWMA of the bytes/s its pulls
achieved and the prompt tokens/s its prefills achieved (`RateEstimate`) and reports both in its
heartbeat; the router folds the fleet's reports into the model the policy prices with
(`TransferModel.calibrated`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

KV_BYTES_70B = 320_000  # K/V bytes per token of a 70B-class GQA model in bf16
GPU_LINK_BYTES_S = 25e9  # between two GPU replicas
GPU_PREFILL_TOKENS_S = 7_000.0  # ServiceModel's 1.4e-4 s per prompt token


@dataclass(frozen=True)
class TransferModel:
    """Cost of pulling K/V, and of recomputing it, in seconds."""

    kv_bytes_per_token: float = KV_BYTES_70B
    bytes_per_s: float = GPU_LINK_BYTES_S
    fixed_s: float = 0.002  # per pull: the request to the holder, pinning, the first byte
    prefill_tokens_per_s: float = GPU_PREFILL_TOKENS_S

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "bytes_per_s", "prefill_tokens_per_s"):
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
    ) -> TransferModel:
        """The same model with measured figures substituted (None or <= 0: keep the current)."""
        changes = {}
        for name, value in (
            ("bytes_per_s", bytes_per_s),
            ("prefill_tokens_per_s", prefill_tokens_per_s),
            ("kv_bytes_per_token", kv_bytes_per_token),
        ):
            if value is not None and value > 0:
                changes[name] = float(value)
        return replace(self, **changes) if changes else self


class RateEstimate:
    """EWMA of a measured rate (amount / seconds), weighting each observation by its duration
    so a large transfer counts more than a tiny one whose time is mostly fixed cost.

    `half_life_s`: seconds of measured work after which an old observation weighs half."""

    def __init__(self, half_life_s: float = 5.0) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be positive")
        self.half_life_s = half_life_s
        self._amount = 0.0
        self._seconds = 0.0
        self.samples = 0

    def observe(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return  # nothing measured (an empty pull, a clock that did not move)
        keep = 0.5 ** (seconds / self.half_life_s)
        self._amount = self._amount * keep + amount
        self._seconds = self._seconds * keep + seconds
        self.samples += 1

    @property
    def rate(self) -> float | None:
        """Amount per second, None before the first observation."""
        return self._amount / self._seconds if self._seconds > 0 else None


def fleet_rate(reports: list[float | int | None]) -> float | None:
    """One figure from the replicas' reported rates: the median of those that measured one
    (0 or missing means not measured yet), so one slow or odd replica does not set the price."""
    values = [float(v) for v in reports if v is not None and v > 0]
    return statistics.median(values) if values else None
