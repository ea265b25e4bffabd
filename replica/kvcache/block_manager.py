"""A sequence's blocks and the prefix cache over them: the hit run a prompt can reuse, the
blocks a sequence is given and commits, and the pull imports that fill blocks from another
replica, over the pool (replica/kvcache/block_pool.py) and the tiers below it
(replica/kvcache/tier_chain.py).

A prompt's leading run may continue from the pool into the tiers; those blocks are moved back
into the pool on allocation (counted as hits) instead of being recomputed. The listeners hear
every block stored, removed and moved (router/protocol/events.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from replica.kvcache.block_pool import BlockPool, NoFreeBlocksError, same_tokens
from replica.kvcache.kv_tiers import LowerTier, TierEvents, TierMove
from replica.kvcache.tier_chain import TierChain
from router.protocol.events import KVEventListener
from router.protocol.hashing import block_hashes
from router.protocol.media import DEVICE

__all__ = ["Allocation", "BlockManager", "BlockStats", "BlockTable", "NoFreeBlocksError"]


@dataclass
class BlockTable:
    """What the manager tracks for one sequence."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained keys of the full blocks so far
    num_registered: int = 0  # leading blocks already offered to the cache
    promoted: dict[str, int] = field(default_factory=dict)  # hit blocks moved in from each lower tier at allocation
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
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)  # of hit_tokens, served from each lower tier
    writeback_hits: int = 0  # evictions whose copy down had been made ahead, off the step


class Allocation(NamedTuple):
    """What `plan` found for a new sequence, for `allocate` to carry out unchanged: its hit run,
    per block (DEVICE, block id) or (lower medium, hash), and the blocks it needs now."""

    num_tokens: int
    run: list[tuple[str, int]]
    blocks: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, host_blocks: int = 0, disk_blocks: int = 0,
                 record_moves: bool = False) -> None:
        """host_blocks / disk_blocks: capacity of the tiers below the pool (0: none). With
        `record_moves`, the copies the tiers need are queued for `take_moves` (an engine with
        the bytes); without, only the bookkeeping runs (a simulator prices the moves itself)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.chain = TierChain(self.pool, host_blocks, disk_blocks, record_moves)
        self.listeners: list[KVEventListener] = []
        self.stats = BlockStats()

    # ---- views -----------------------------------------------------------------------------
    @property
    def tiers(self) -> list[LowerTier]:
        return self.chain.tiers

    @property
    def hash_to_block(self) -> dict[int, int]:
        return self.pool.hash_to_block

    @property
    def ref_count(self) -> list[int]:
        return self.pool.ref_count

    @property
    def block_hash(self) -> list[int | None]:
        return self.pool.block_hash

    @property
    def block_tokens(self) -> list[tuple[int, ...] | None]:
        return self.pool.block_tokens

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold reusable K/V."""
        return self.pool.num_cached

    @property
    def num_available(self) -> int:
        return self.pool.num_available

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.pool.num_available

    def tier(self, medium: str) -> LowerTier | None:
        return self.chain.tier(medium)

    def take_moves(self) -> list[TierMove]:
        """The copies decided since the last call, in the order they must run (before the next
        forward pass reads or writes any block they touch)."""
        return self.chain.take_moves()

    def plan_writeback(self, max_blocks: int, max_shadows: int) -> list[TierMove]:
        return self.chain.plan_writeback(max_blocks, max_shadows)

    def finish_writeback(self, ok: bool = True) -> None:
        self.chain.finish_writeback(ok)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- the hit run -----------------------------------------------------------------------
    def _hit_run(self, table: BlockTable, num_tokens: int) -> list[tuple[str, int]]:
        """The leading run a new sequence can hit, leaving its last token to compute: per block,
        (DEVICE, block id) or (lower medium, hash), up to the first block held nowhere (or held
        with other tokens)."""
        bs = self.block_size
        hashes, tokens = table.hashes[: max(num_tokens - 1, 0) // bs], table.token_ids
        device = self.pool.leading_run(hashes, tokens, bs)
        run = [(DEVICE, b) for b in device]
        if not self.chain:
            return run
        for i in range(len(device), len(hashes)):
            h = hashes[i]
            block = self.pool.hash_to_block.get(h)
            if block is not None:
                if not self.pool.holds(block, tokens, i * bs, bs):
                    break
                run.append((DEVICE, block))
                continue
            tier = self.chain.holder(h)
            if tier is None or not tier.promote:
                break
            if not same_tokens(tier.entries[h].tokens, tokens, i * bs, bs):
                break
            run.append((tier.medium, h))
        return run

    def _reserve(self, hit: int, num_tokens: int, max_compute: int | None) -> int:
        """Blocks a new sequence needs now: its `hit` blocks plus room for its first chunk."""
        tokens = num_tokens if max_compute is None else min(num_tokens, hit * self.block_size + max_compute)
        return max(self.blocks_needed(tokens), hit)

    # ---- allocation ----------------------------------------------------------------------
    def plan(self, table: BlockTable, num_tokens: int, max_compute: int | None = None) -> Allocation | None:
        """The allocation of a new sequence if it fits now, else None: one walk of its hit run,
        which `allocate(table, plan=...)` then takes as found. `max_compute`: tokens computed in
        the first step (blocks are reserved per chunk, as in vLLM); None reserves them all."""
        run = self._hit_run(table, num_tokens)
        device = [b for m, b in run if m == DEVICE]
        # hits sitting in the LRU stop being available once we take them; a lower tier's hit
        # needs a fresh pool block like a computed one
        reclaimed = sum(1 for b in device if self.pool.ref_count[b] == 0)
        blocks = self._reserve(len(run), num_tokens, max_compute)
        if blocks - len(device) > self.pool.num_available - reclaimed:
            return None
        return Allocation(num_tokens, run, blocks)

    def can_allocate(self, table: BlockTable, num_tokens: int, max_compute: int | None = None) -> bool:
        return self.plan(table, num_tokens, max_compute) is not None

    def allocate(self, table: BlockTable, num_tokens: int = 0, max_compute: int | None = None,
                 plan: Allocation | None = None) -> int:
        """Give a new sequence its blocks; returns the number of tokens served from cache.

        The cache is looked up for the whole `num_tokens`; blocks beyond the hits are reserved
        for `max_compute` tokens only (None: all of them). Later chunks grow it with `append`.
        `plan`: what `plan()` found just before, with nothing changed since (the scheduler's
        admission), instead of walking the hit run again.
        """
        assert not table.block_ids, "sequence already holds blocks"
        if plan is None:
            plan = self.plan(table, num_tokens, max_compute)
            if plan is None:
                raise NoFreeBlocksError(f"cannot fit {num_tokens} tokens")
        num_tokens, run = plan.num_tokens, plan.run
        n = len(run)
        if n < (num_tokens - 1) // self.block_size and n < len(table.hashes):
            self.stats.collisions += table.hashes[n] in self.pool.hash_to_block  # same key, other tokens
        lower = []  # (index in the run, tier, its entry): out of their tier before anything is evicted into it
        for i, (medium, ref) in enumerate(run):
            if medium == DEVICE:
                self.pool.take(ref)
            else:
                tier = self.chain.tier(medium)
                lower.append((i, tier, tier.take(ref)))
        fresh = self._new_blocks(plan.blocks - (n - len(lower)))
        table.block_ids = [ref if medium == DEVICE else -1 for medium, ref in run]
        table.promoted = {}
        events = TierEvents()
        for (i, tier, entry), block in zip(lower, fresh, strict=False):
            h = run[i][1]
            self.chain.promote(tier, h, entry, block, events)
            table.block_ids[i] = block
            self.pool.register(block, h, entry.position, entry.tokens)
            table.promoted[tier.medium] = table.promoted.get(tier.medium, 0) + 1
        table.block_ids += fresh[len(lower) :]
        table.num_registered = n
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += n * self.block_size
        for medium, blocks in table.promoted.items():
            self.stats.tier_hit_tokens[medium] = self.stats.tier_hit_tokens.get(medium, 0) + blocks * self.block_size
        events.deliver(self.listeners)
        return n * self.block_size

    def can_append(self, table: BlockTable, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(table.block_ids) <= self.pool.num_available

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
        self._register_new([(i, table.block_ids[i]) for i in range(table.num_registered, full)], table.hashes, token_ids)
        table.num_registered = max(table.num_registered, full)

    def free(self, table: BlockTable) -> None:
        """Release a sequence's blocks; hashed ones stay cached (tail first in LRU order)."""
        for block in reversed(table.block_ids):
            self.pool.release(block)
        table.block_ids = []
        table.num_registered = 0

    def clear_cache(self) -> int:
        """Forget every cached hash (e.g. after a weight reload): blocks in use keep their K/V
        for their own sequence but can no longer be hit, and go to the free list when freed."""
        n = len(self.pool.hash_to_block)
        self.pool.clear()
        n += self.chain.clear()
        for listener in self.listeners:
            listener.cleared()
        return n

    def cached_hashes(self) -> list[tuple[int, int]]:
        """(hash, position) of every block served from this pool, for a full index resync."""
        return [(h, self.pool.block_pos[b]) for h, b in self.pool.hash_to_block.items()]

    def held_blocks(self) -> list[tuple[int, int, str]]:
        """(hash, position, medium) of every block held here in any tier, for a full resync."""
        held = [(h, p, DEVICE) for h, p in self.cached_hashes()]
        for tier in self.chain.tiers:
            held += [(h, e.position, tier.medium) for h, e in tier.entries.items()]
        return held

    # ---- K/V transfer between replicas (replica/kv_io/kv_transfer.py) ---------------------------
    def pin_prefix(self, hashes: list[int], token_ids: list[int] | None = None) -> list[int]:
        """Block ids of the leading run of `hashes` held here (cached or in use), each given a
        reference so eviction cannot reuse it while its K/V is read; `unpin` gives them back.
        With `token_ids` (the prompt), a block holding other tokens (a collision) ends the run."""
        run = self.pool.leading_run(hashes, token_ids, self.block_size)
        for block in run:
            self.pool.take(block)
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
            block = self.pool.hash_to_block.get(h)
            if block is not None and self.pool.ref_count[block] == 0:
                self.pool.make_coldest(block)
                moved += 1
        return moved

    def begin_import(self, hashes: list[int], start: int = 0, max_blocks: int | None = None) -> list[tuple[int, int]]:
        """Blocks to receive K/V for `hashes[start:]` not held here yet: (index in `hashes`,
        block id) pairs, taken from the free list or the LRU. At most `max_blocks` (default: all
        that are available); the caller copies the K/V in, then calls `finish_import`."""
        held = [self.pool.hash_to_block[h] for h in hashes if h in self.pool.hash_to_block]
        for block in held:  # the prompt's blocks held here must not be evicted to make room
            self.pool.take(block)
        try:
            available = self.pool.num_available
            limit = available if max_blocks is None else min(max_blocks, available)
            wanted = [i for i in range(start, len(hashes)) if hashes[i] not in self.pool.hash_to_block][:limit]
            return list(zip(wanted, self._new_blocks(len(wanted)), strict=True))
        finally:
            self.unpin(held)

    def finish_import(self, pairs: list[tuple[int, int]], hashes: list[int], token_ids: list[int] | None) -> int:
        """Register imported blocks under their hashes exactly as if computed here: cached (ref 0,
        newest in the LRU) and announced to the listeners. Returns how many were registered."""
        registered = self._register_new(pairs, hashes, token_ids)
        for _, block in pairs:
            self.pool.release(block)  # registered: cached, newest; a twin's copy: free again
        return registered

    def abort_import(self, pairs: list[tuple[int, int]]) -> None:
        """The copy failed: the taken blocks go back to the free list, nothing is registered."""
        for _, block in pairs:
            self.pool.give_back(block)

    # ---- internals -----------------------------------------------------------------------
    def _new_blocks(self, n: int) -> list[int]:
        """Free blocks first, then the least recently used cached ones (one removal event),
        which move down into the tiers when there are any."""
        blocks, evicted = self.pool.pop(n)
        if evicted:
            self.stats.evictions += len(evicted)
            for listener in self.listeners:
                listener.removed([e.hash for e in evicted])
            self.stats.writeback_hits += self.chain.keep_evicted(evicted, self.listeners)
        return blocks

    def _register_new(self, pairs: list[tuple[int, int]], hashes: list[int], token_ids: list[int] | None) -> int:
        """Register blocks[i] under hashes[i] for each (i, block) whose hash no block holds yet
        (a twin computed or imported concurrently keeps the slot), drop their lower copies and
        announce them. Returns how many were registered."""
        bs = self.block_size
        stored: list[int] = []
        positions: list[int] = []
        for i, block in pairs:
            h = hashes[i]
            if h in self.pool.hash_to_block:
                continue
            end = (i + 1) * bs
            tokens = tuple(token_ids[end - bs : end]) if token_ids is not None and len(token_ids) >= end else None
            self.pool.register(block, h, i, tokens)
            stored.append(h)
            positions.append(i)
        if stored:
            self.chain.drop(stored, self.listeners)  # computed again here (its lower copy was past a miss)
            for listener in self.listeners:
                listener.stored(stored, positions)
        return len(stored)
