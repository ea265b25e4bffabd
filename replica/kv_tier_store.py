"""The bytes of the K/V tiers below the pool, and the copies the block manager decides.

The host tier is its own buffer (pinned host memory when the pool is on a GPU, so copies use
the copy engine); the disk tier is a bounded file mapped into memory, unlinked as soon as it is
mapped so that nothing is left on disk when the process ends, however it ends. A block is stored
contiguously in both, [2 (k, v), layers, kv_heads, block_size, head_dim], so one block is one
slice and one file range. On this CPU machine pool and host tier are both RAM: the copies are
still real copies between separate buffers, and their measured rates are what the replica
reports and the router prices (kv_host_bytes_per_s, kv_disk_bytes_per_s).
"""

from __future__ import annotations

import math
import os
import tempfile
import time

import torch

from replica.attention import KVPool
from replica.kv_tiers import CopyStats, TierMove
from router.protocol.media import DEVICE, DISK, HOST


class TierStore:
    def __init__(self, pool: KVPool, block_size: int, host_blocks: int = 0, disk_blocks: int = 0,
                 disk_dir: str | None = None) -> None:
        layers, heads, slots, dim = pool.k.shape
        if slots % block_size:
            raise ValueError("pool slots must be a multiple of block_size")
        self.pool = pool
        self.block_size = block_size
        self.block_shape = (2, layers, heads, block_size, dim)
        self.block_bytes = math.prod(self.block_shape) * pool.k.element_size()
        self.stats = CopyStats()
        self.disk_path: str | None = None
        self._stores: dict[str, torch.Tensor] = {}
        if host_blocks > 0:
            pinned = pool.k.device.type == "cuda"
            self._stores[HOST] = torch.empty((host_blocks, *self.block_shape), dtype=pool.k.dtype, pin_memory=pinned)
        if disk_blocks > 0:
            self._stores[DISK] = self._map_file(disk_blocks, pool.k.dtype, disk_dir)

    def _map_file(self, blocks: int, dtype: torch.dtype, disk_dir: str | None) -> torch.Tensor:
        """A file of exactly `blocks` blocks (sparse until written), mapped shared and unlinked."""
        fd, path = tempfile.mkstemp(prefix="prefixgate-kv-", suffix=".bin", dir=disk_dir)
        try:
            numel = blocks * math.prod(self.block_shape)
            os.ftruncate(fd, numel * torch.empty((), dtype=dtype).element_size())
            store = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        finally:
            os.close(fd)
            os.unlink(path)  # the mapping keeps the file alive; nothing outlives the process
        self.disk_path = path
        return store.view(blocks, *self.block_shape)

    def capacity(self, medium: str) -> int:
        store = self._stores.get(medium)
        return 0 if store is None else store.shape[0]

    # ---- the copies ----------------------------------------------------------------------
    def apply(self, moves: list[TierMove]) -> None:
        """Run the moves in their order, batched: consecutive moves of one direction go as one
        copy unless a move reads or writes a slot an earlier move of the batch wrote (a tier of
        a few blocks can reuse a slot within one step)."""
        for src, dst, group in _batches(moves):
            start = time.perf_counter()
            data = self._read(src, [m.src_slot for m in group])
            self._write(dst, [m.dst_slot for m in group], data)
            if self.pool.k.device.type == "cuda":
                torch.cuda.synchronize(self.pool.k.device)
            self.stats.add((src, dst), len(group), len(group) * self.block_bytes, time.perf_counter() - start)

    def _blocks(self, t: torch.Tensor) -> torch.Tensor:
        layers, heads, slots, dim = t.shape
        return t.view(layers, heads, slots // self.block_size, self.block_size, dim)

    def _read(self, medium: str, slots: list[int]) -> torch.Tensor:
        """[n, 2, layers, heads, block_size, dim] of these slots (a copy)."""
        if medium == DEVICE:
            ids = torch.tensor(slots, dtype=torch.long, device=self.pool.k.device)
            k = self._blocks(self.pool.k).index_select(2, ids).permute(2, 0, 1, 3, 4)
            v = self._blocks(self.pool.v).index_select(2, ids).permute(2, 0, 1, 3, 4)
            return torch.stack((k, v), dim=1)
        return self._stores[medium].index_select(0, torch.tensor(slots, dtype=torch.long))

    def _write(self, medium: str, slots: list[int], data: torch.Tensor) -> None:
        if medium == DEVICE:
            ids = torch.tensor(slots, dtype=torch.long, device=self.pool.k.device)
            data = data.to(self.pool.k.device, non_blocking=True)
            self._blocks(self.pool.k).index_copy_(2, ids, data[:, 0].permute(1, 2, 0, 3, 4))
            self._blocks(self.pool.v).index_copy_(2, ids, data[:, 1].permute(1, 2, 0, 3, 4))
            return
        store = self._stores[medium]
        store.index_copy_(0, torch.tensor(slots, dtype=torch.long), data.to(store.device))


def _batches(moves: list[TierMove]) -> list[tuple[str, str, list[TierMove]]]:
    batches: list[tuple[str, str, list[TierMove]]] = []
    written: set[int] = set()
    for m in moves:
        last = batches[-1] if batches else None
        if last is None or (last[0], last[1]) != (m.src, m.dst) or m.dst_slot in written or (
            m.src == m.dst and m.src_slot in written
        ):
            last = (m.src, m.dst, [])
            batches.append(last)
            written = set()
        last[2].append(m)
        written.add(m.dst_slot)
    return batches


__all__ = ["TierStore"]
