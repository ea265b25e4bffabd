"""K/V tiers below the device pool: which blocks each holds, never the bytes (torch-free).

A block evicted from the device pool moves to the host tier, and one evicted from the host tier
moves to the disk tier; each tier is an LRU of its own with its own capacity, and a block lives
in exactly one tier of a replica at a time. A prefix hit in a lower tier is moved back into the
pool before the prefill instead of being recomputed (BlockManager.allocate).

The block manager decides the moves and records them as `TierMove`s, in the order they must
happen (a slot is always read before it is written again); whoever holds the bytes performs
them before the next forward pass (replica/kv_io/kv_tier_store.py on a real engine, a modelled copy
time in the simulators). So the same rules run with tensors and without.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from router.protocol.media import DEVICE, LOWER_MEDIA


class TierMove(NamedTuple):
    """Copy one block's K/V from (src medium, slot) to (dst medium, slot); a device slot is a
    pool block id."""

    src: str
    src_slot: int
    dst: str
    dst_slot: int


@dataclass(slots=True)
class TierEntry:
    slot: int
    position: int  # block index within its prompt (what publishers filter their depth on)
    tokens: tuple[int, ...] | None  # the block's tokens: a hit checks them (hashes can collide)


@dataclass
class TierStats:
    demotions: int = 0  # blocks moved into this tier from the one above
    promotions: int = 0  # blocks moved from this tier back into the device pool (hits)
    dropped: int = 0  # blocks that left this tier for no tier below: their K/V is gone


@dataclass
class LowerTier:
    """One tier below the pool: an LRU of block hashes, each in a slot of the tier's store."""

    medium: str
    capacity: int
    entries: OrderedDict[int, TierEntry] = field(default_factory=OrderedDict)  # oldest first
    # a hit here is moved back into the pool; False where copying it back is slower than
    # recomputing it (a slow disk): a prefix's run then ends here and the rest is computed
    promote: bool = True
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        if self.medium not in LOWER_MEDIA:
            raise ValueError(f"a lower tier's medium is one of {LOWER_MEDIA}, not {self.medium!r}")
        if self.capacity <= 0:
            raise ValueError(f"{self.medium} tier capacity must be positive, got {self.capacity}")
        self._free: deque[int] = deque(range(self.capacity))

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.entries

    def get(self, block_hash: int) -> TierEntry | None:
        return self.entries.get(block_hash)

    @property
    def full(self) -> bool:
        return not self._free

    def oldest(self) -> tuple[int, TierEntry]:
        """The next to leave (the tier is non-empty)."""
        return next(iter(self.entries.items()))

    def insert(self, block_hash: int, position: int, tokens: tuple[int, ...] | None) -> int:
        """Take a free slot for a block (the tier must not be full); returns the slot."""
        slot = self._free.popleft()
        self.entries[block_hash] = TierEntry(slot, position, tokens)
        return slot

    def reserve(self) -> int:
        """A free slot for a copy made ahead of need (a write-behind shadow), not an entry yet."""
        return self._free.popleft()

    def adopt(self, block_hash: int, slot: int, position: int, tokens: tuple[int, ...] | None) -> None:
        """A reserved slot that already holds this block's K/V becomes its entry."""
        self.entries[block_hash] = TierEntry(slot, position, tokens)

    def take(self, block_hash: int) -> TierEntry:
        """Remove a block; its slot stays reserved until `release`, so that nothing is written
        into it before its bytes were copied out."""
        return self.entries.pop(block_hash)

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def clear(self) -> list[int]:
        hashes = list(self.entries)
        for e in self.entries.values():
            self._free.append(e.slot)
        self.entries.clear()
        return hashes


RATE_WEIGHT = 0.2  # weight of the newest copy in the moving average of a direction's bytes/s
MIN_TIMED_BYTES = 1 << 16  # copies smaller than this are too short to time meaningfully


@dataclass
class CopyStats:
    bytes: dict[tuple[str, str], int] = field(default_factory=dict)  # (src, dst) -> bytes moved
    blocks: dict[tuple[str, str], int] = field(default_factory=dict)
    rate: dict[tuple[str, str], float] = field(default_factory=dict)  # moving average, bytes/s

    def add(self, key: tuple[str, str], blocks: int, nbytes: int, seconds: float) -> None:
        self.bytes[key] = self.bytes.get(key, 0) + nbytes
        self.blocks[key] = self.blocks.get(key, 0) + blocks
        if nbytes >= MIN_TIMED_BYTES and seconds > 0:
            now = nbytes / seconds
            old = self.rate.get(key)
            self.rate[key] = now if old is None else (1 - RATE_WEIGHT) * old + RATE_WEIGHT * now

    def promotion_rate(self, medium: str) -> int:
        """Measured bytes/s of bringing blocks from `medium` back into the pool (0: none yet)."""
        return int(self.rate.get((medium, DEVICE), 0.0))


class TierMover(Protocol):
    """Whoever holds the tiers' bytes (replica/kv_io/kv_tier_store.py): runs the recorded moves."""

    stats: CopyStats

    def apply(self, moves: list[TierMove]) -> None: ...


class TierEvents:
    """Cache membership changes of one operation, per medium, delivered in order afterwards."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, list[int], list[int]]] = []  # (op, medium, hashes, positions)

    def add(self, op: str, medium: str, block_hash: int, position: int = 0) -> None:
        if self.items and self.items[-1][0] == op and self.items[-1][1] == medium:
            self.items[-1][2].append(block_hash)
            self.items[-1][3].append(position)
        else:
            self.items.append((op, medium, [block_hash], [position]))

    def deliver(self, listeners) -> None:
        for op, medium, hashes, positions in self.items:
            for listener in listeners:
                if op == "+":
                    listener.stored(hashes, positions, medium=medium)
                else:
                    listener.removed(hashes, medium=medium)
        self.items.clear()


__all__ = ["CopyStats", "LowerTier", "TierEntry", "TierEvents", "TierMove", "TierMover", "TierStats"]
