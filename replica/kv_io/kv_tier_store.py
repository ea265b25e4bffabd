"""The bytes of the K/V tiers below the pool, and the copies the block manager decides.

The host tier is its own buffer in the pool's layout (pinned host memory when the pool is on a
GPU, so copies use the copy engine); the disk tier is a bounded file mapped into memory,
unlinked as soon as it is mapped so that nothing is left on disk when the process ends, however
it ends, with each block one contiguous range [2 (k, v), layers, kv_heads, block_size, head_dim]. On this CPU machine pool and host tier are both RAM: the copies are
still real copies between separate buffers, and their measured rates are what the replica
reports and the router prices (kv_host_bytes_per_s, kv_disk_bytes_per_s).
"""

from __future__ import annotations

import math
import os
import tempfile
import time

import torch

from replica.kernels.attention_metadata import KVPool
from replica.kvcache.kv_tiers import CopyStats, TierMove
from router.protocol.media import DEVICE, HOST


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
        self._host: KVPool | None = None
        self._disk: torch.Tensor | None = None
        if host_blocks > 0:  # the pool's own layout: a copy between them is one strided copy per tensor
            pinned = pool.k.device.type == "cuda"
            shape = (layers, heads, host_blocks * block_size, dim)
            self._host = KVPool(torch.empty(shape, dtype=pool.k.dtype, pin_memory=pinned),
                                torch.empty(shape, dtype=pool.k.dtype, pin_memory=pinned))
        if disk_blocks > 0:
            self._disk = self._map_file(disk_blocks, pool.k.dtype, disk_dir)

    def _map_file(self, blocks: int, dtype: torch.dtype, disk_dir: str | None) -> torch.Tensor:
        """A file of exactly `blocks` blocks (sparse until written), mapped shared and unlinked;
        each block one contiguous range."""
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
        if medium == HOST:
            return 0 if self._host is None else self._host.k.shape[2] // self.block_size
        return 0 if self._disk is None else self._disk.shape[0]

    # ---- the copies ----------------------------------------------------------------------
    def apply(self, moves: list[TierMove]) -> None:
        """Run the moves in their order, batched: consecutive moves of one direction go as one
        copy unless a move reads or writes a slot an earlier move of the batch wrote (a tier of
        a few blocks can reuse a slot within one step)."""
        for src, dst, group in _batches(moves):
            start = time.perf_counter()
            k, v = self._read(src, [m.src_slot for m in group])
            self._write(dst, [m.dst_slot for m in group], k, v)
            if self.pool.k.device.type == "cuda":
                torch.cuda.synchronize(self.pool.k.device)
            self.stats.add((src, dst), len(group), len(group) * self.block_bytes, time.perf_counter() - start)

    def _paged(self, medium: str) -> KVPool | None:
        return self.pool if medium == DEVICE else self._host if medium == HOST else None

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        """[layers, heads, slots, dim] -> [layers, heads, blocks, block_size, dim] (no copy)."""
        layers, heads, slots, dim = t.shape
        return t.view(layers, heads, slots // self.block_size, self.block_size, dim)

    def _read(self, medium: str, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these slots, each [layers, heads, n, block_size, dim]."""
        paged = self._paged(medium)
        if paged is not None:
            ids = torch.tensor(slots, dtype=torch.long, device=paged.k.device)
            return self._view(paged.k).index_select(2, ids), self._view(paged.v).index_select(2, ids)
        blocks = self._disk.index_select(0, torch.tensor(slots, dtype=torch.long))  # [n, 2, L, H, bs, D]
        return blocks[:, 0].permute(1, 2, 0, 3, 4), blocks[:, 1].permute(1, 2, 0, 3, 4)

    def _write(self, medium: str, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        paged = self._paged(medium)
        if paged is not None:
            ids = torch.tensor(slots, dtype=torch.long, device=paged.k.device)
            self._view(paged.k).index_copy_(2, ids, k.to(paged.k.device, non_blocking=True))
            self._view(paged.v).index_copy_(2, ids, v.to(paged.v.device, non_blocking=True))
            return
        blocks = torch.stack((k, v)).permute(3, 0, 1, 2, 4, 5).cpu()  # [n, 2, L, H, bs, D]
        self._disk.index_copy_(0, torch.tensor(slots, dtype=torch.long), blocks)


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
