"""Paged block allocation with a content-addressed prefix cache.

The manager owns block ids only, never tensors: the model runner keeps the K/V pool and the
simulator runs this same class with no tensors at all. A block is in exactly one state:
  free      ref_count == 0, no hash, in `_free`
  cached    ref_count == 0, hashed, in `_lru` (evictable, oldest first)
  in use    ref_count > 0 (hashed once its K/V is complete and no other block holds that hash)

Below the pool, optional K/V tiers (host memory, then local disk: replica/kvcache/kv_tiers.py) keep
what the pool evicts; a prompt's leading run may continue into them, and those blocks are
moved back into the pool on allocation (counted as hits) instead of being recomputed. Each
block lives in one medium at a time, and the listeners hear every move as a removal from one
medium and a store into another.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from replica.kvcache.kv_tiers import LowerTier, TierEvents, TierMove
from router.protocol.events import KVEventListener
from router.protocol.hashing import block_hashes
from router.protocol.media import DEVICE, DISK, HOST


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


class NoFreeBlocksError(RuntimeError):
    """Raised when allocation is attempted without checking `can_allocate` first."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, host_blocks: int = 0, disk_blocks: int = 0,
                 record_moves: bool = False) -> None:
        """host_blocks / disk_blocks: capacity of the tiers below the pool (0: none). With
        `record_moves`, the copies the tiers need are queued for `take_moves` (an engine with
        the bytes); without, only the bookkeeping runs (a simulator prices the moves itself)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if host_blocks < 0 or disk_blocks < 0:
            raise ValueError("tier capacities must be >= 0")
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
        # fastest first; a tier evicts into the next one
        self.tiers: list[LowerTier] = [LowerTier(m, n) for m, n in ((HOST, host_blocks), (DISK, disk_blocks)) if n > 0]
        self.record_moves = record_moves
        self._moves: list[TierMove] = []
        # write-behind: pool blocks whose K/V already has a copy in the first tier's slot, made
        # off the step before they are evicted (plan_writeback), so evicting them copies nothing
        self._shadow: dict[int, int] = {}  # pool block -> slot in tiers[0]
        self._writing: list[int] = []  # blocks pinned while their copy runs

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

    def tier(self, medium: str) -> LowerTier | None:
        return next((t for t in self.tiers if t.medium == medium), None)

    def take_moves(self) -> list[TierMove]:
        """The copies decided since the last call, in the order they must run (before the next
        forward pass reads or writes any block they touch)."""
        moves, self._moves = self._moves, []
        return moves

    def plan_writeback(self, max_blocks: int, max_shadows: int) -> list[TierMove]:
        """Copies of the pool's coldest cached blocks into free slots of the first tier, to run
        off the engine thread while the forward pass runs: the blocks are pinned (no step can
        reuse them) until `finish_writeback`. When one of them is evicted later, its copy is
        already in place and the eviction copies nothing. Never evicts anything to make room;
        at most `max_shadows` such copies exist at a time."""
        if not self.tiers or self._writing:
            return []
        tier = self.tiers[0]
        moves: list[TierMove] = []
        for block in self._lru:  # oldest first
            if len(moves) >= max_blocks or len(self._shadow) >= max_shadows or tier.full:
                break
            if block not in self._shadow:
                self._shadow[block] = slot = tier.reserve()
                moves.append(TierMove(DEVICE, block, tier.medium, slot))
        self._writing = [m.src_slot for m in moves]
        for block in self._writing:
            self._take(block)
        return moves

    def finish_writeback(self, ok: bool = True) -> None:
        """The write-behind copies are done: their blocks go back to the cold end of the LRU,
        in the order they had (`ok` False: the copy failed, so the copies are forgotten)."""
        blocks, self._writing = self._writing, []
        for block in reversed(blocks):
            if not ok:
                self._drop_shadow(block)
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self._lru[block] = None
                self._lru.move_to_end(block, last=False)

    def _drop_shadow(self, block: int) -> None:
        slot = self._shadow.pop(block, None)
        if slot is not None:
            self.tiers[0].release(slot)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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

    def _hit_run(self, table: BlockTable, num_tokens: int) -> list[tuple[str, int]]:
        """The leading run a new sequence can hit, leaving its last token to compute: per block,
        (DEVICE, block id) or (lower medium, hash), up to the first block held nowhere (or held
        with other tokens)."""
        bs = self.block_size
        hashes, token_ids = table.hashes[: max(num_tokens - 1, 0) // bs], table.token_ids
        device = self._leading_run(hashes, token_ids)
        run = [(DEVICE, b) for b in device]
        if not self.tiers:
            return run
        for i in range(len(device), len(hashes)):
            h = hashes[i]
            block = self.hash_to_block.get(h)
            if block is not None:
                stored = self.block_tokens[block]
                if token_ids is not None and stored is not None and tuple(token_ids[i * bs : (i + 1) * bs]) != stored:
                    break
                run.append((DEVICE, block))
                continue
            tier = next((t for t in self.tiers if h in t), None)
            if tier is None or not tier.promote:
                break
            stored = tier.entries[h].tokens
            if token_ids is not None and stored is not None and tuple(token_ids[i * bs : (i + 1) * bs]) != stored:
                break
            run.append((tier.medium, h))
        return run

    def _reserve(self, hit: int, num_tokens: int, max_compute: int | None) -> int:
        """Blocks a new sequence needs now: its `hit` blocks plus room for its first chunk."""
        tokens = num_tokens if max_compute is None else min(num_tokens, hit * self.block_size + max_compute)
        return max(self.blocks_needed(tokens), hit)

    def can_allocate(self, table: BlockTable, num_tokens: int, max_compute: int | None = None) -> bool:
        """`max_compute`: tokens computed in the first step (blocks are reserved per chunk, as in
        vLLM); None reserves the whole `num_tokens`."""
        run = self._hit_run(table, num_tokens)
        device = [b for m, b in run if m == DEVICE]
        # hits sitting in the LRU stop being available once we take them; a lower tier's hit
        # needs a fresh pool block like a computed one
        reclaimed = sum(1 for b in device if self.ref_count[b] == 0)
        needed = self._reserve(len(run), num_tokens, max_compute) - len(device)
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
        run = self._hit_run(table, num_tokens)
        n = len(run)
        if n < (num_tokens - 1) // self.block_size and n < len(table.hashes):
            self.stats.collisions += table.hashes[n] in self.hash_to_block  # same key, other tokens
        lower = []  # (index in the run, tier, its entry): out of their tier before anything is evicted into it
        for i, (medium, ref) in enumerate(run):
            if medium == DEVICE:
                self._take(ref)
            else:
                tier = self.tier(medium)
                lower.append((i, tier, tier.take(ref)))
        fresh = self._new_blocks(self._reserve(n, num_tokens, max_compute) - (n - len(lower)))
        table.block_ids = [ref if medium == DEVICE else -1 for medium, ref in run]
        table.promoted = {}
        events = TierEvents()
        for (i, tier, entry), block in zip(lower, fresh, strict=False):
            h = run[i][1]
            self._record(TierMove(tier.medium, entry.slot, DEVICE, block))
            tier.release(entry.slot)
            tier.stats.promotions += 1
            table.block_ids[i] = block
            self._register(block, h, entry.position, entry.tokens)
            table.promoted[tier.medium] = table.promoted.get(tier.medium, 0) + 1
            events.add("-", tier.medium, h)
            events.add("+", DEVICE, h, entry.position)
        table.block_ids += fresh[len(lower) :]
        table.num_registered = n
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += n * self.block_size
        for medium, blocks in table.promoted.items():
            self.stats.tier_hit_tokens[medium] = self.stats.tier_hit_tokens.get(medium, 0) + blocks * self.block_size
        events.deliver(self.listeners)
        return n * self.block_size

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
                end = (i + 1) * self.block_size
                self._register(block, h, i, tuple(token_ids[end - self.block_size : end]) if len(token_ids) >= end else None)
                stored.append(h)
                positions.append(i)
        table.num_registered = max(table.num_registered, full)
        if stored:
            self._drop_lower(stored)  # computed again here (its lower copy was past a miss)
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
        n = len(self.hash_to_block) + sum(len(t) for t in self.tiers)
        for block in list(self.hash_to_block.values()):
            self._unhash(block)
        for block in list(self._shadow):
            self._drop_shadow(block)
        self._free.extend(self._lru)
        self._lru.clear()
        for tier in self.tiers:
            tier.clear()
        for listener in self.listeners:
            listener.cleared()
        return n

    def cached_hashes(self) -> list[tuple[int, int]]:
        """(hash, position) of every block served from this pool, for a full index resync."""
        return [(h, self.block_pos[b]) for h, b in self.hash_to_block.items()]

    def held_blocks(self) -> list[tuple[int, int, str]]:
        """(hash, position, medium) of every block held here in any tier, for a full resync."""
        held = [(h, p, DEVICE) for h, p in self.cached_hashes()]
        for tier in self.tiers:
            held += [(h, e.position, tier.medium) for h, e in tier.entries.items()]
        return held

    # ---- K/V transfer between replicas (replica/kv_io/kv_transfer.py) ---------------------------
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
            end = (i + 1) * bs
            self._register(block, h, i, tuple(token_ids[end - bs : end]) if token_ids is not None and len(token_ids) >= end else None)
            self._lru[block] = None
            stored.append(h)
            positions.append(i)
        if stored:
            self._drop_lower(stored)
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
        """Free blocks first, then evict the least recently used cached ones (one event), which
        move down into the tiers when there are any."""
        if n > self.num_available:
            raise NoFreeBlocksError("block pool exhausted")
        blocks: list[int] = []
        evicted: list[tuple[int, int, int, tuple[int, ...] | None]] = []  # (block, hash, position, tokens)
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._lru.popitem(last=False)
                pos, tokens = self.block_pos[block], self.block_tokens[block]
                evicted.append((block, self._unhash(block), pos, tokens))
            self.ref_count[block] = 1
            blocks.append(block)
        if evicted:
            self.stats.evictions += len(evicted)
            for listener in self.listeners:
                listener.removed([h for _, h, _, _ in evicted])
            if self.tiers:
                events = TierEvents()
                for block, h, pos, tokens in evicted:
                    slot = self._shadow.pop(block, None)
                    if slot is None:
                        self._spill(0, h, pos, tokens, DEVICE, block, events)
                    else:  # written behind already: the copy is in place
                        self.tiers[0].adopt(h, slot, pos, tokens)
                        self.tiers[0].stats.demotions += 1
                        self.stats.writeback_hits += 1
                        events.add("+", self.tiers[0].medium, h, pos)
                events.deliver(self.listeners)
        return blocks

    def _spill(self, level: int, h: int, pos: int, tokens: tuple[int, ...] | None, src: str, src_slot: int,
               events: TierEvents) -> None:
        """Move a block leaving medium `src` into tier `level`, making room there first by
        spilling that tier's oldest block one level down (so its slot is read before reuse)."""
        if level >= len(self.tiers):
            return  # no tier below: the K/V is gone (its removal was announced)
        tier = self.tiers[level]
        if tier.full and level == 0:  # a write-behind copy is cheaper to give up than a held block
            spare = next((b for b in self._shadow if b not in self._writing), None)
            if spare is not None:
                self._drop_shadow(spare)
        if tier.full and not tier.entries:  # every slot is being read back into the pool right now
            self._spill(level + 1, h, pos, tokens, src, src_slot, events)
            return
        if tier.full:
            old_hash, old = tier.oldest()
            tier.take(old_hash)
            events.add("-", tier.medium, old_hash)
            if level + 1 < len(self.tiers):
                self._spill(level + 1, old_hash, old.position, old.tokens, tier.medium, old.slot, events)
            else:
                tier.stats.dropped += 1
            tier.release(old.slot)
        slot = tier.insert(h, pos, tokens)
        self._record(TierMove(src, src_slot, tier.medium, slot))
        tier.stats.demotions += 1
        events.add("+", tier.medium, h, pos)

    def _drop_lower(self, hashes: list[int]) -> None:
        """These blocks are now in the pool: forget any lower copy, so each lives in one medium."""
        if not self.tiers:
            return
        events = TierEvents()
        for h in hashes:
            for tier in self.tiers:
                if h in tier:
                    tier.release(tier.take(h).slot)
                    events.add("-", tier.medium, h)
        events.deliver(self.listeners)

    def _record(self, move: TierMove) -> None:
        if self.record_moves:
            self._moves.append(move)

    def _register(self, block: int, h: int, pos: int, tokens: tuple[int, ...] | None) -> None:
        self.hash_to_block[h] = block
        self.block_hash[block] = h
        self.block_pos[block] = pos
        self.block_tokens[block] = tokens

    def _unhash(self, block: int) -> int:
        h = self.block_hash[block]
        assert h is not None
        self.block_hash[block] = None
        self.block_tokens[block] = None
        del self.hash_to_block[h]
        return h
