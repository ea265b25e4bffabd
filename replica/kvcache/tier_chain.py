"""The tiers below one pool as a chain (host memory, then local disk): where an evicted block
goes, how a lower hit comes back, and the write-behind copies made ahead of eviction.

Each block lives in one medium at a time. Every move is recorded as a `TierMove` in the order
it must run (a slot is read before it is written again) and announced as a removal from one
medium and a store into another (`TierEvents`).
"""

from __future__ import annotations

from replica.kvcache.block_pool import BlockPool, Evicted
from replica.kvcache.kv_tiers import LowerTier, TierEntry, TierEvents, TierMove
from router.protocol.media import DEVICE, DISK, HOST


class TierChain:
    def __init__(self, pool: BlockPool, host_blocks: int, disk_blocks: int, record_moves: bool) -> None:
        """`record_moves`: queue the copies for `take_moves` (an engine with the bytes); without,
        only the bookkeeping runs (a simulator prices the moves itself)."""
        if host_blocks < 0 or disk_blocks < 0:
            raise ValueError("tier capacities must be >= 0")
        self.pool = pool
        # fastest first; a tier evicts into the next one
        self.tiers: list[LowerTier] = [LowerTier(m, n) for m, n in ((HOST, host_blocks), (DISK, disk_blocks)) if n > 0]
        self.record_moves = record_moves
        self.moves: list[TierMove] = []
        # write-behind: pool blocks whose K/V already has a copy in the first tier's slot, made
        # off the step before they are evicted (plan_writeback), so evicting them copies nothing
        self.shadow: dict[int, int] = {}  # pool block -> slot in tiers[0]
        self.writing: list[int] = []  # blocks pinned while their copy runs

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def tier(self, medium: str) -> LowerTier | None:
        return next((t for t in self.tiers if t.medium == medium), None)

    def holder(self, h: int) -> LowerTier | None:
        return next((t for t in self.tiers if h in t), None)

    def record(self, move: TierMove) -> None:
        if self.record_moves:
            self.moves.append(move)

    def take_moves(self) -> list[TierMove]:
        moves, self.moves = self.moves, []
        return moves

    # ---- blocks leaving the pool ------------------------------------------------------------
    def keep_evicted(self, evicted: list[Evicted], listeners) -> int:
        """Blocks the pool just reused move into the first tier (the coldest of each full tier
        one level further down); written-behind ones are in place already: returns how many."""
        if not self.tiers or not evicted:
            return 0
        written_behind = 0
        events = TierEvents()
        first = self.tiers[0]
        for e in evicted:
            slot = self.shadow.pop(e.block, None)
            if slot is None:
                self._spill(0, e.hash, e.position, e.tokens, DEVICE, e.block, events)
            else:
                first.adopt(e.hash, slot, e.position, e.tokens)
                first.stats.demotions += 1
                written_behind += 1
                events.add("+", first.medium, e.hash, e.position)
        events.deliver(listeners)
        return written_behind

    def _spill(self, level: int, h: int, pos: int, tokens: tuple[int, ...] | None, src: str, src_slot: int,
               events: TierEvents) -> None:
        """Move a block leaving medium `src` into tier `level`, making room there first by
        spilling that tier's oldest block one level down (so its slot is read before reuse)."""
        if level >= len(self.tiers):
            return  # no tier below: the K/V is gone (its removal was announced)
        tier = self.tiers[level]
        if tier.full and level == 0:  # a write-behind copy is cheaper to give up than a held block
            spare = next((b for b in self.shadow if b not in self.writing), None)
            if spare is not None:
                self.drop_shadow(spare)
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
        self.record(TierMove(src, src_slot, tier.medium, slot))
        tier.stats.demotions += 1
        events.add("+", tier.medium, h, pos)

    # ---- blocks coming back ------------------------------------------------------------------
    def promote(self, tier: LowerTier, h: int, entry: TierEntry, block: int, events: TierEvents) -> None:
        """A lower hit taken out of `tier` (`tier.take`) is copied into pool `block`."""
        self.record(TierMove(tier.medium, entry.slot, DEVICE, block))
        tier.release(entry.slot)
        tier.stats.promotions += 1
        events.add("-", tier.medium, h)
        events.add("+", DEVICE, h, entry.position)

    def drop(self, hashes: list[int], listeners) -> None:
        """These blocks are now in the pool: forget any lower copy, so each lives in one medium."""
        if not self.tiers:
            return
        events = TierEvents()
        for h in hashes:
            for tier in self.tiers:
                if h in tier:
                    tier.release(tier.take(h).slot)
                    events.add("-", tier.medium, h)
        events.deliver(listeners)

    # ---- write-behind --------------------------------------------------------------------------
    def plan_writeback(self, max_blocks: int, max_shadows: int) -> list[TierMove]:
        """Copies of the pool's coldest cached blocks into free slots of the first tier, to run
        off the engine thread while the forward pass runs: the blocks are pinned (no step can
        reuse them) until `finish_writeback`. When one of them is evicted later, its copy is
        already in place and the eviction copies nothing. Never evicts anything to make room;
        at most `max_shadows` such copies exist at a time."""
        if not self.tiers or self.writing:
            return []
        tier = self.tiers[0]
        moves: list[TierMove] = []
        for block in self.pool.lru:  # oldest first
            if len(moves) >= max_blocks or len(self.shadow) >= max_shadows or tier.full:
                break
            if block not in self.shadow:
                self.shadow[block] = slot = tier.reserve()
                moves.append(TierMove(DEVICE, block, tier.medium, slot))
        self.writing = [m.src_slot for m in moves]
        for block in self.writing:
            self.pool.take(block)
        return moves

    def finish_writeback(self, ok: bool = True) -> None:
        """The write-behind copies are done: their blocks go back to the cold end of the LRU,
        in the order they had (`ok` False: the copy failed, so the copies are forgotten)."""
        blocks, self.writing = self.writing, []
        for block in reversed(blocks):
            if not ok:
                self.drop_shadow(block)
            self.pool.release(block)
            if block in self.pool.lru:
                self.pool.make_coldest(block)

    def drop_shadow(self, block: int) -> None:
        slot = self.shadow.pop(block, None)
        if slot is not None:
            self.tiers[0].release(slot)

    def clear(self) -> int:
        """Forget every lower block and write-behind copy; returns how many blocks were held."""
        n = sum(len(t) for t in self.tiers)
        for block in list(self.shadow):
            self.drop_shadow(block)
        for tier in self.tiers:
            tier.clear()
        return n
