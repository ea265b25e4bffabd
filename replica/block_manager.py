"""Paged block allocation with a content-addressed prefix cache.

The manager owns block ids only, never tensors: the model runner keeps the K/V pool and the
simulator runs this same class with no tensors at all. A block is in exactly one state:
  free      ref_count == 0, no hash, in `_free`
  cached    ref_count == 0, hashed, in `_lru` (evictable, oldest first)
  in use    ref_count > 0 (hashed once its K/V is complete and no other block holds that hash)
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from router.protocol.hashing import block_hashes


class KVEventListener(Protocol):
    """Receives cache membership changes (the replica publishes them to Redis)."""

    def stored(self, hashes: list[int], positions: list[int]) -> None:
        """Blocks became cached; positions[i] is the block index of hashes[i] in its prompt."""

    def removed(self, hashes: list[int]) -> None:
        """Cached blocks were evicted."""

    def cleared(self) -> None:
        """Every cached block was dropped."""


@dataclass
class BlockTable:
    """What the manager tracks for one sequence."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained keys of the full blocks so far
    num_registered: int = 0  # leading blocks already offered to the cache
    # the sequence's tokens (the engine shares its list): a hash hit is only taken when the
    # cached block holds these same tokens, since xxh64 is not collision resistant. None: the
    # caller has no tokens (the simulator), hits are trusted.
    token_ids: list[int] | None = None


@dataclass
class BlockStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    collisions: int = 0  # hash hits refused because the block held other tokens


class NoFreeBlocksError(RuntimeError):
    """Raised when allocation is attempted without checking `can_allocate` first."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_pos = [0] * num_blocks  # block index within the prompt of a hashed block
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # tokens of a hashed block
        self.hash_to_block: dict[int, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.listeners: list[KVEventListener] = []
        self.stats = BlockStats()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold reusable K/V."""
        return len(self._lru)

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, hashes: list[int], num_tokens: int, token_ids: list[int] | None = None) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least the last token to compute.

        With `token_ids`, a block whose stored tokens differ (a hash collision) ends the prefix.
        """
        return self._leading_run(hashes[: max(num_tokens - 1, 0) // self.block_size], token_ids)

    def _leading_run(self, hashes: list[int], token_ids: list[int] | None) -> list[int]:
        """Block ids held here for hashes[0], hashes[1], ... up to the first one missing (or,
        with `token_ids`, holding other tokens: a hash collision)."""
        bs = self.block_size
        run: list[int] = []
        for i, h in enumerate(hashes):
            block = self.hash_to_block.get(h)
            if block is None:
                break
            stored = self.block_tokens[block]
            if token_ids is not None and stored is not None and tuple(token_ids[i * bs : (i + 1) * bs]) != stored:
                break
            run.append(block)
        return run

    def _reserve(self, hit: list[int], num_tokens: int, max_compute: int | None) -> int:
        """Blocks a new sequence needs now: its hits plus room for its first chunk."""
        tokens = num_tokens if max_compute is None else min(num_tokens, len(hit) * self.block_size + max_compute)
        return max(self.blocks_needed(tokens), len(hit))

    def can_allocate(self, table: BlockTable, num_tokens: int, max_compute: int | None = None) -> bool:
        """`max_compute`: tokens computed in the first step (blocks are reserved per chunk, as in
        vLLM); None reserves the whole `num_tokens`."""
        hit = self.cached_prefix(table.hashes, num_tokens, table.token_ids)
        # hits sitting in the LRU stop being available once we take them
        reclaimed = sum(1 for b in hit if self.ref_count[b] == 0)
        needed = self._reserve(hit, num_tokens, max_compute) - len(hit)
        return needed <= self.num_available - reclaimed

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, table: BlockTable, num_tokens: int, max_compute: int | None = None) -> int:
        """Give a new sequence its blocks; returns the number of tokens served from cache.

        The cache is looked up for the whole `num_tokens`; blocks beyond the hits are reserved
        for `max_compute` tokens only (None: all of them). Later chunks grow it with `append`.
        """
        assert not table.block_ids, "sequence already holds blocks"
        if not self.can_allocate(table, num_tokens, max_compute):
            raise NoFreeBlocksError(f"cannot fit {num_tokens} tokens")
        hit = self.cached_prefix(table.hashes, num_tokens, table.token_ids)
        if len(hit) < (num_tokens - 1) // self.block_size and len(hit) < len(table.hashes):
            self.stats.collisions += table.hashes[len(hit)] in self.hash_to_block  # same key, other tokens
        for block in hit:
            self._take(block)
        table.block_ids = hit + self._new_blocks(self._reserve(hit, num_tokens, max_compute) - len(hit))
        table.num_registered = len(hit)
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += len(hit) * self.block_size
        return len(hit) * self.block_size

    def can_append(self, table: BlockTable, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(table.block_ids) <= self.num_available

    def append(self, table: BlockTable, num_tokens: int) -> None:
        """Grow a running sequence's table to hold `num_tokens` tokens (a decode or the next chunk)."""
        missing = self.blocks_needed(num_tokens) - len(table.block_ids)
        if missing > 0:
            table.block_ids += self._new_blocks(missing)

    def commit(self, table: BlockTable, token_ids: list[int], num_computed: int, seed: int) -> None:
        """Register the blocks whose K/V is now complete, so later requests can hit them."""
        full = num_computed // self.block_size
        if len(table.hashes) < full:
            parent = table.hashes[-1] if table.hashes else seed
            table.hashes += block_hashes(
                token_ids[: full * self.block_size], self.block_size, seed, len(table.hashes), parent
            )
        stored: list[int] = []
        positions: list[int] = []
        for i in range(table.num_registered, full):
            h, block = table.hashes[i], table.block_ids[i]
            if h not in self.hash_to_block:  # a twin computed concurrently keeps the slot
                self.hash_to_block[h] = block
                self.block_hash[block] = h
                self.block_pos[block] = i
                end = (i + 1) * self.block_size
                self.block_tokens[block] = tuple(token_ids[end - self.block_size : end]) if len(token_ids) >= end else None
                stored.append(h)
                positions.append(i)
        table.num_registered = max(table.num_registered, full)
        if stored:
            for listener in self.listeners:
                listener.stored(stored, positions)

    def free(self, table: BlockTable) -> None:
        """Release a sequence's blocks; hashed ones stay cached (tail first in LRU order)."""
        for block in reversed(table.block_ids):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0
            if self.ref_count[block] == 0:
                if self.block_hash[block] is not None:
                    self._lru[block] = None
                else:
                    self._free.append(block)
        table.block_ids = []
        table.num_registered = 0

    def clear_cache(self) -> int:
        """Forget every cached hash (e.g. after a weight reload): blocks in use keep their K/V
        for their own sequence but can no longer be hit, and go to the free list when freed."""
        n = len(self.hash_to_block)
        for block in list(self.hash_to_block.values()):
            self._unhash(block)
        self._free.extend(self._lru)
        self._lru.clear()
        for listener in self.listeners:
            listener.cleared()
        return n

    def cached_hashes(self) -> list[tuple[int, int]]:
        """(hash, position) of every block served from this pool, for a full index resync."""
        return [(h, self.block_pos[b]) for h, b in self.hash_to_block.items()]

    # ---- K/V transfer between replicas (replica/kv_transfer.py) ---------------------------
    def pin_prefix(self, hashes: list[int], token_ids: list[int] | None = None) -> list[int]:
        """Block ids of the leading run of `hashes` held here (cached or in use), each given a
        reference so eviction cannot reuse it while its K/V is read; `unpin` gives them back.
        With `token_ids` (the prompt), a block holding other tokens (a collision) ends the run."""
        run = self._leading_run(hashes, token_ids)
        for block in run:
            self._take(block)
        return run

    def unpin(self, block_ids: list[int]) -> None:
        """Release blocks taken by `pin_prefix` (the tail of the run becomes the oldest)."""
        self.free(BlockTable(block_ids=list(block_ids)))

    def demote(self, hashes: list[int]) -> int:
        """Make these cached, unreferenced blocks the next to evict, the last hash first (as
        `free` orders a prompt: its shared head stays longest), e.g. after another replica
        pulled a copy: the copy there is the one its conversation will use. Blocks in use or
        not held are left alone. Returns how many moved."""
        moved = 0
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is not None and self.ref_count[block] == 0:
                self._lru.move_to_end(block, last=False)
                moved += 1
        return moved

    def begin_import(self, hashes: list[int], start: int = 0, max_blocks: int | None = None) -> list[tuple[int, int]]:
        """Blocks to receive K/V for `hashes[start:]` not held here yet: (index in `hashes`,
        block id) pairs, taken from the free list or the LRU. At most `max_blocks` (default: all
        that are available); the caller copies the K/V in, then calls `finish_import`."""
        held = [self.hash_to_block[h] for h in hashes if h in self.hash_to_block]
        for block in held:  # the prompt's blocks held here must not be evicted to make room
            self._take(block)
        try:
            limit = self.num_available if max_blocks is None else min(max_blocks, self.num_available)
            wanted = [i for i in range(start, len(hashes)) if hashes[i] not in self.hash_to_block][:limit]
            return list(zip(wanted, self._new_blocks(len(wanted)), strict=True))
        finally:
            self.unpin(held)

    def finish_import(self, pairs: list[tuple[int, int]], hashes: list[int], token_ids: list[int] | None) -> int:
        """Register imported blocks under their hashes exactly as if computed here: cached (ref 0,
        newest in the LRU) and announced to the listeners. Returns how many were registered."""
        bs = self.block_size
        stored: list[int] = []
        positions: list[int] = []
        for i, block in pairs:
            h = hashes[i]
            self.ref_count[block] = 0
            if h in self.hash_to_block:  # computed meanwhile by a twin: keep that one
                self._free.append(block)
                continue
            self.hash_to_block[h] = block
            self.block_hash[block] = h
            self.block_pos[block] = i
            end = (i + 1) * bs
            self.block_tokens[block] = tuple(token_ids[end - bs : end]) if token_ids is not None and len(token_ids) >= end else None
            self._lru[block] = None
            stored.append(h)
            positions.append(i)
        if stored:
            for listener in self.listeners:
                listener.stored(stored, positions)
        return len(stored)

    def abort_import(self, pairs: list[tuple[int, int]]) -> None:
        """The copy failed: the taken blocks go back to the free list, nothing is registered."""
        for _, block in pairs:
            self.ref_count[block] = 0
            self._free.append(block)

    # ---- internals -----------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self._lru[block]
        self.ref_count[block] += 1

    def _new_blocks(self, n: int) -> list[int]:
        """Free blocks first, then evict the least recently used cached ones (one event)."""
        if n > self.num_available:
            raise NoFreeBlocksError("block pool exhausted")
        blocks: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._lru.popitem(last=False)
                evicted.append(self._unhash(block))
            self.ref_count[block] = 1
            blocks.append(block)
        if evicted:
            self.stats.evictions += len(evicted)
            for listener in self.listeners:
                listener.removed(evicted)
        return blocks

    def _unhash(self, block: int) -> int:
        h = self.block_hash[block]
        assert h is not None
        self.block_hash[block] = None
        self.block_tokens[block] = None
        del self.hash_to_block[h]
        return h
