"""In-memory prefix index: which replica holds which block hash, and in which medium.

What the Redis index holds, exactly and at once: the simulator's replicas feed it through the
same KV-event hook the real ones publish with, and router/sim/index.py answers the router's
lookups from it the way the Redis lookup does. Block hashes are chained (block i's
key stands for the whole prefix up to it), so a match is the run of leading blocks a replica
holds, in any medium, stopping at the first one it lacks. As in Redis, a block's holders are
members (router/protocol/media.py: "rid" in the device pool, "rid|host" in a lower tier) and a
replica holds each block in one medium: storing it in another moves it.
"""

from __future__ import annotations

from collections.abc import Iterator, Set

from router.index.redis_index import ReplicaEntry
from router.protocol.media import DEVICE, member

_NONE: frozenset[str] = frozenset()


class InMemoryIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}  # hash -> members, as the block's Redis set
        self._by_replica: dict[str, dict[int, str]] = {}  # replica -> hash -> medium

    def stored(self, replica_id: str, hashes: list[int], medium: str = DEVICE) -> None:
        owned = self._by_replica.setdefault(replica_id, {})
        holders = self._holders
        held = member(replica_id, medium)
        for h in hashes:
            old = owned.get(h)
            if old is not None and old != medium:
                self._drop(h, member(replica_id, old))
            s = holders.get(h)
            if s is None:
                holders[h] = {held}
            else:
                s.add(held)
            owned[h] = medium

    def removed(self, replica_id: str, hashes: list[int], medium: str = DEVICE) -> None:
        """Blocks leave `medium` (a block the replica holds in another medium stays, as an SREM
        of this medium's member leaves the other in Redis)."""
        owned = self._by_replica.get(replica_id)
        if owned is None:
            return
        held = member(replica_id, medium)
        for h in hashes:
            if owned.get(h) == medium:
                del owned[h]
                self._drop(h, held)

    def clear(self, replica_id: str) -> None:
        for h, medium in self._by_replica.pop(replica_id, {}).items():
            self._drop(h, member(replica_id, medium))

    def _drop(self, block_hash: int, held: str) -> None:
        s = self._holders.get(block_hash)
        if s is not None:
            s.discard(held)
            if not s:
                del self._holders[block_hash]

    def _leading(self, replica_id: str, hashes: list[int]) -> Iterator[str]:
        """Media of the replica's leading run of these blocks, in chain order."""
        owned = self._by_replica.get(replica_id)
        if owned is None:
            return
        for h in hashes:
            medium = owned.get(h)
            if medium is None:
                return
            yield medium

    def match(self, hashes: list[int], replica_ids: list[str]) -> dict[str, int]:
        """Leading-block match count per replica, any medium (0 for replicas that hold none)."""
        return {rid: sum(1 for _ in self._leading(rid, hashes)) for rid in replica_ids}

    def match_media(self, hashes: list[int], replica_ids: list[str]) -> dict[str, ReplicaEntry]:
        """`match` with its per-medium split, as a lookup reports it (`ReplicaEntry.tier_blocks`:
        the matched blocks in each lower tier), counted exactly."""
        out: dict[str, ReplicaEntry] = {}
        for rid in replica_ids:
            tiers: dict[str, int] = {}
            n = 0
            for medium in self._leading(rid, hashes):
                n += 1
                if medium != DEVICE:
                    tiers[medium] = tiers.get(medium, 0) + 1
            out[rid] = ReplicaEntry(n, tier_blocks=tiers)
        return out

    def holders(self, block_hash: int) -> Set[str]:
        """Members holding this block (read-only): what the Redis index's set for the block
        holds ("rid", or "rid|medium" for a lower tier), for the simulator's lookup
        (router/sim/index.py)."""
        return self._holders.get(block_hash) or _NONE

    def __len__(self) -> int:
        """Number of distinct hashes held by at least one replica."""
        return len(self._holders)
