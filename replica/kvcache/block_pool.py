"""The pool's blocks and their states, as vLLM v1's BlockPool keeps them: ids only, never
tensors (the model runner owns the K/V; the simulator runs this with none).

A block is in exactly one state:
  free      ref_count == 0, no hash, in `free_ids`
  cached    ref_count == 0, hashed, in `lru` (evictable, oldest first)
  in use    ref_count > 0 (hashed once its K/V is complete and no other block holds that hash)
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import NamedTuple


class NoFreeBlocksError(RuntimeError):
    """Raised when allocation is attempted without checking `can_allocate` first."""


class Evicted(NamedTuple):
    """A cached block reused for new K/V: what it held, for the tiers below to keep."""

    block: int
    hash: int
    position: int
    tokens: tuple[int, ...] | None


def same_tokens(stored: tuple[int, ...] | None, tokens: list[int] | None, start: int, size: int) -> bool:
    """Whether a block that holds `stored` holds tokens[start:start+size]: a hash hit is only
    taken when it does, since xxh64 is not collision resistant. No tokens on either side (the
    simulator): trusted. For pool blocks and lower tiers' entries alike."""
    return tokens is None or stored is None or tuple(tokens[start : start + size]) == stored


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_pos = [0] * num_blocks  # block index within the prompt of a hashed block
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # tokens of a hashed block
        self.hash_to_block: dict[int, int] = {}
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.lru: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold reusable K/V."""
        return len(self.lru)

    @property
    def num_available(self) -> int:
        return len(self.free_ids) + len(self.lru)

    def holds(self, block: int, tokens: list[int] | None, start: int, size: int) -> bool:
        """Whether a hashed block holds these tokens (tokens[start:start+size])."""
        return same_tokens(self.block_tokens[block], tokens, start, size)

    def leading_run(self, hashes: list[int], tokens: list[int] | None, block_size: int) -> list[int]:
        """Block ids held here for hashes[0], hashes[1], ... up to the first one missing or
        holding other tokens."""
        run: list[int] = []
        for i, h in enumerate(hashes):
            block = self.hash_to_block.get(h)
            if block is None or not self.holds(block, tokens, i * block_size, block_size):
                break
            run.append(block)
        return run

    def take(self, block: int) -> None:
        """One more reference: a cached block leaves the LRU."""
        if self.ref_count[block] == 0:
            del self.lru[block]
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        """One reference fewer; at none a hashed block stays cached (newest), others are free."""
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0
        if self.ref_count[block] == 0:
            if self.block_hash[block] is not None:
                self.lru[block] = None
            else:
                self.free_ids.append(block)

    def make_coldest(self, block: int) -> None:
        """An unreferenced cached block becomes the next to evict."""
        self.lru.move_to_end(block, last=False)

    def pop(self, n: int) -> tuple[list[int], list[Evicted]]:
        """`n` blocks with one reference each: free ones first, then the least recently used
        cached ones, whose hashes are dropped and returned."""
        if n > self.num_available:
            raise NoFreeBlocksError("block pool exhausted")
        blocks: list[int] = []
        evicted: list[Evicted] = []
        for _ in range(n):
            if self.free_ids:
                block = self.free_ids.popleft()
            else:
                block, _ = self.lru.popitem(last=False)
                pos, tokens = self.block_pos[block], self.block_tokens[block]
                evicted.append(Evicted(block, self.unhash(block), pos, tokens))
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks, evicted

    def give_back(self, block: int) -> None:
        """A block taken by `pop` and never used (an aborted import): free again."""
        self.ref_count[block] = 0
        self.free_ids.append(block)

    def register(self, block: int, h: int, pos: int, tokens: tuple[int, ...] | None) -> None:
        self.hash_to_block[h] = block
        self.block_hash[block] = h
        self.block_pos[block] = pos
        self.block_tokens[block] = tokens

    def unhash(self, block: int) -> int:
        h = self.block_hash[block]
        assert h is not None
        self.block_hash[block] = None
        self.block_tokens[block] = None
        del self.hash_to_block[h]
        return h

    def clear(self) -> None:
        """Forget every hash: cached blocks become free, blocks in use go free when released."""
        for block in list(self.hash_to_block.values()):
            self.unhash(block)
        self.free_ids.extend(self.lru)
        self.lru.clear()
