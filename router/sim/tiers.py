"""K/V tiers below a simulated replica's pool: their sizes, and what a hit in one costs.

Each replica's BlockManager keeps what its pool evicts in a host tier, then a disk tier, each an
LRU of its own (replica/kvcache/kv_tiers.py); a prefix hit there is copied back into the pool before the
prefill. The simulators keep the bookkeeping real and model only the copy, at the transfer
model's tier rates (router/costs/transfer_model.py `tier_s`: tokens x K/V bytes per token / rate),
charged before the prefill like a pull's transfer. The same figures go into the heartbeat
(occupancy and rates), so the router prices tier hits from what the replicas report, as live.
"""

from __future__ import annotations

from dataclasses import dataclass

from replica.kvcache.block_manager import BlockManager
from router.costs.tier_costs import tier_rate
from router.costs.transfer_model import TransferModel


@dataclass(frozen=True)
class TierConfig:
    """One replica's tiers below its pool, in blocks (0: none)."""

    host_blocks: int = 0
    disk_blocks: int = 0  # below the host tier

    def __post_init__(self) -> None:
        if self.host_blocks < 0 or self.disk_blocks < 0:
            raise ValueError("tier sizes must be >= 0")

    @classmethod
    def from_flags(cls, host: str, disk: str, pool_blocks: int) -> TierConfig:
        """Sizes as the command lines take them: blocks ('1800') or a multiple of the pool ('4x')."""
        return cls(_blocks(host, pool_blocks), _blocks(disk, pool_blocks))

    @property
    def blocks(self) -> int:
        """Blocks held below the pool, both tiers together."""
        return self.host_blocks + self.disk_blocks


def tier_heartbeat(bm: BlockManager, transfer: TransferModel) -> dict[str, int]:
    """The tier fields of a heartbeat (router/protocol/redis_schema.py): each tier's occupancy
    and its modelled rate back into the pool."""
    out: dict[str, int] = {}
    for tier in bm.tiers:
        m = tier.medium
        out |= {f"{m}_blocks": len(tier), f"{m}_capacity_blocks": tier.capacity,
                f"kv_{m}_bytes_per_s": int(tier_rate(transfer, m))}
    return out


def _blocks(spec: str, pool_blocks: int) -> int:
    return round(float(spec[:-1]) * pool_blocks) if spec.endswith("x") else int(spec)
