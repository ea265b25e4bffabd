"""What a hit in a K/V tier below the pool costs: the copy back into the pool at the transfer
model's tier rates. Shared by the simulators and the simulated-compute engine."""

from __future__ import annotations

from collections.abc import Mapping

from router.costs.transfer_model import TransferModel
from router.protocol.media import DISK, HOST


def copy_s(transfer: TransferModel, promoted: Mapping[str, int], block_size: int) -> float:
    """Time to copy `promoted` blocks (per lower medium) back into the pool."""
    return sum(transfer.tier_s(medium, n * block_size) for medium, n in promoted.items())


def tier_rate(transfer: TransferModel, medium: str) -> float:
    """Modelled bytes/s from a lower tier back into the pool."""
    return {HOST: transfer.host_bytes_per_s, DISK: transfer.disk_bytes_per_s}[medium]
