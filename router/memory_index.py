"""In-memory prefix index: which replica holds which block hash.

What the Redis index holds, exactly and at once: the simulator's replicas feed it through the
same KV-event hook the real ones publish with, and router/sim/index.py answers the router's
lookups from it the way the Redis lookup does. Block hashes are chained (block i's
key stands for the whole prefix up to it), so a match is the run of leading blocks a replica
holds, stopping at the first one it lacks.
"""

from __future__ import annotations

from collections.abc import Set

_NONE: frozenset[str] = frozenset()


class InMemoryIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._by_replica: dict[str, set[int]] = {}

    def stored(self, replica_id: str, hashes: list[int]) -> None:
        owned = self._by_replica.setdefault(replica_id, set())
        holders = self._holders
        for h in hashes:
            s = holders.get(h)
            if s is None:
                holders[h] = {replica_id}
            else:
                s.add(replica_id)
            owned.add(h)

    def removed(self, replica_id: str, hashes: list[int]) -> None:
        owned = self._by_replica.get(replica_id)
        if owned is None:
            return
        for h in hashes:
            owned.discard(h)
            s = self._holders.get(h)
            if s is not None:
                s.discard(replica_id)
                if not s:
                    del self._holders[h]

    def clear(self, replica_id: str) -> None:
        owned = self._by_replica.pop(replica_id, set())
        for h in owned:
            s = self._holders.get(h)
            if s is not None:
                s.discard(replica_id)
                if not s:
                    del self._holders[h]

    def match(self, hashes: list[int], replica_ids: list[str]) -> dict[str, int]:
        """Leading-block match count per replica (0 for replicas that hold none)."""
        result = dict.fromkeys(replica_ids, 0)
        alive: set[str] | None = None
        for i, h in enumerate(hashes, 1):
            holders = self._holders.get(h)
            if not holders:
                break
            alive = (holders & result.keys()) if alive is None else (alive & holders)
            if not alive:
                break
            for r in alive:
                result[r] = i
        return result

    def holders(self, block_hash: int) -> Set[str]:
        """Replicas holding this block (read-only): what the Redis index's set for the
        block holds, for the simulator's lookup (router/sim/index.py)."""
        return self._holders.get(block_hash) or _NONE

    def __len__(self) -> int:
        """Number of distinct hashes held by at least one replica."""
        return len(self._holders)
