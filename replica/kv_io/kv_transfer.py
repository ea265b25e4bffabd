"""Export and import of cached K/V blocks: what one replica hands another (docs/kv-pull.md).

A block's K/V is position-dependent but replica-independent: the same model, dtype and block
size compute the same numbers for the same chained hash on every replica. So a replica can
copy a prefix's blocks out of its pool and another can insert them under the same hashes, as
if it had computed them (ref counts, LRU, events to the index listeners all as usual).

The export is a leading run of the requested hashes that the holder really has, read while the
blocks are pinned (a reference each), so eviction cannot hand a block to another request
mid-copy. The payload is numpy arrays (zero-copy out of Ray's object store on the reader's
side) in the pool's own layout per block: [layers, kv_heads, blocks, block_size, head_dim].
No Ray here: the transport lives in replica/kv_io/kv_pull.py.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from replica.engine_config import EngineConfig
    from replica.kernels.attention_metadata import KVPool
    from replica.kvcache.block_manager import BlockManager


class KvTransferError(RuntimeError):
    """Blocks that cannot go into this pool (another model shape, dtype or block size)."""


@dataclass
class KvBlocks:
    """The K/V of a leading run of a prompt's blocks, as it travels between replicas."""

    hashes: list[int]  # chained hashes of the prompt's blocks first .. first+n-1
    k: np.ndarray  # [layers, kv_heads, n, block_size, head_dim]; bf16 travels as its int16 bits
    v: np.ndarray
    dtype: str  # the pool's torch dtype, e.g. "float32"
    first: int = 0  # index in the prompt of the first block (the receiver held the ones before)

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def release(self) -> None:
        """Drop the arrays once imported: read zero-copy, they pin Ray object-store memory for as
        long as anything (a request's arguments, for its whole life) holds this object."""
        self.k = self.v = np.empty((0,), dtype=self.k.dtype)


def _blocks_view(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """[layers, heads, slots, dim] -> [layers, heads, blocks, block_size, dim] (no copy)."""
    layers, heads, slots, dim = t.shape
    return t.view(layers, heads, slots // block_size, block_size, dim)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.cpu()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only (zero-copy out of Ray's object store): only read here
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def read_blocks(pool: KVPool, block_ids: list[int], hashes: list[int], block_size: int, first: int = 0) -> KvBlocks:
    """Copy pinned blocks out of the pool (`hashes` are theirs, from prompt block `first` on).
    Safe off the engine thread: a pinned, hashed block is complete, so no step writes it."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=pool.k.device)
    k = _blocks_view(pool.k, block_size).index_select(2, ids)
    v = _blocks_view(pool.v, block_size).index_select(2, ids)
    dtype = str(pool.k.dtype).removeprefix("torch.")
    return KvBlocks(list(hashes[: len(block_ids)]), _to_numpy(k), _to_numpy(v), dtype, first)


def check_compatible(kv: KvBlocks, pool: KVPool, block_size: int) -> None:
    """Refuse blocks computed by another model shape, dtype or block size."""
    layers, heads, _, dim = pool.k.shape
    want = (layers, heads, kv.num_blocks, block_size, dim)
    dtype = str(pool.k.dtype).removeprefix("torch.")
    if kv.k.shape != want or kv.v.shape != want or kv.dtype != dtype:
        raise KvTransferError(
            f"blocks of shape {kv.k.shape} {kv.dtype} do not fit this pool ({want} {dtype})"
        )


def write_blocks(pool: KVPool, block_ids: list[int], kv: KvBlocks, rows: list[int], block_size: int) -> None:
    """Copy rows `rows` of the received blocks into pool blocks `block_ids` (engine thread)."""
    if not block_ids:
        return
    every = rows == list(range(kv.num_blocks))  # the usual case: no row selection, one copy less
    src = torch.tensor(rows, dtype=torch.long)
    ids = torch.tensor(block_ids, dtype=torch.long, device=pool.k.device)
    for dst, a in ((pool.k, kv.k), (pool.v, kv.v)):
        chunk = _to_torch(a, dst.dtype)
        chunk = (chunk if every else chunk.index_select(2, src)).to(dst.device)
        _blocks_view(dst, block_size).index_copy_(2, ids, chunk)


# ---- engine-level operations (run on the engine's thread: they touch the block manager) ----
class _Runner(Protocol):
    pool: KVPool


class KvEngine(Protocol):
    """What the operations below use of an engine (replica/engine.py's LLMEngine is one): its
    block size, block manager, K/V pool and tier moves. Named here, not imported, so this module
    stays below the engine that calls it."""

    config: EngineConfig
    blocks: BlockManager
    runner: _Runner

    def apply_tier_moves(self) -> None: ...


def pin(engine: KvEngine, hashes: list[int], token_ids: list[int] | None, first: int = 0) -> list[int]:
    """Pin the run of `hashes[first:]` the engine holds (`token_ids`: the whole prompt, to
    refuse collisions); returns their block ids."""
    tokens = None if token_ids is None else token_ids[first * engine.config.block_size :]
    return engine.blocks.pin_prefix(hashes[first:], tokens)


def import_blocks(engine: KvEngine, kv: KvBlocks, hashes: list[int], token_ids: list[int] | None) -> int:
    """Insert received blocks whose hashes match the prompt's own (`hashes`, recomputed here, so
    a wrong or foreign payload can never enter the cache under a prompt's key). Blocks already
    held are skipped; returns how many blocks were registered."""
    check_compatible(kv, engine.runner.pool, engine.config.block_size)
    f, n = kv.first, 0
    while n < kv.num_blocks and f + n < len(hashes) and hashes[f + n] == kv.hashes[n]:
        n += 1
    blocks = engine.blocks
    pairs = blocks.begin_import(hashes[: f + n], start=f) if n else []
    engine.apply_tier_moves()  # blocks evicted to make room are copied down before being written
    try:
        write_blocks(engine.runner.pool, [b for _, b in pairs], kv, [i - f for i, _ in pairs], engine.config.block_size)
    except Exception:
        blocks.abort_import(pairs)
        raise
    return blocks.finish_import(pairs, hashes, token_ids)


def export_prefix(engine: KvEngine, hashes: list[int], token_ids: list[int] | None, first: int = 0) -> KvBlocks:
    """Pin, read and release in one call, for single-threaded use (tests, benchmarks); a replica
    pins and releases on the engine thread and reads off it (PrefixCacheReplica.export_kv)."""
    block_ids = pin(engine, hashes, token_ids, first)
    try:
        return read_blocks(engine.runner.pool, block_ids, hashes[first:], engine.config.block_size, first)
    finally:
        engine.blocks.unpin(block_ids)
