"""The Redis index's answers, computed from the simulator's exact in-memory index.

`SimIndex.lookup` is `RedisIndex.lookup` without Redis: the lookup script's work (holder count
per block, in-flight marks where nobody holds a block, a few holders sampled where a match
ends) done on `InMemoryIndex`, then `RedisIndex`'s own walk turns it into matches, so the
router sees what the live lookup would return, sampling and `keep` bound included. Nothing
lags: a block is listed the instant its prefill completes, as if published at once.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from router.index.memory_index import InMemoryIndex
from router.index.redis_index import Lookup, RedisConfig, RedisIndex


class SimIndex:
    def __init__(self, blocks: InMemoryIndex, clock: Callable[[], float], *, sample: int = RedisConfig.sample,
                 keep: int = RedisConfig.keep, session_ttl_s: float = RedisConfig.session_ttl_s,
                 seed: int | None = 0) -> None:
        self.blocks = blocks
        self.clock = clock
        self.session_ttl_s = session_ttl_s
        self.rng = random.Random(seed)  # SRANDMEMBER's draws
        # only for its walk (no connection is ever opened): the same code turns counts and
        # samples into matches live and here
        self._walker = RedisIndex(RedisConfig("redis://simulated.invalid/0", sample=sample, keep=keep))
        self._inflight: dict[int, tuple[str, float]] = {}  # hash -> (replica, expires), oldest first
        self._sessions: dict[str, tuple[str, float]] = {}  # session -> (replica, expires), oldest first
        self.lookups = 0

    @property
    def sample(self) -> int:
        return self._walker.config.sample

    def lookup(self, hashes: list[int], session_id: str | None = None) -> Lookup:
        """What `RedisIndex.lookup(hashes, None, session_id)` answers for this state."""
        self.lookups += 1
        now = self.clock()
        cards: dict[int, int] = {}
        held: list = []
        pending: dict[int, str] = {}
        for i, h in enumerate(hashes):  # LOOKUP_SCRIPT's first loop
            holders = self.blocks.holders(h)
            card = len(holders)
            if card == 0:
                mark = self._inflight.get(h)
                if mark is None or mark[1] <= now:
                    break
                card, pending[i] = -1, mark[0]
            cards[i] = card
            held.append(holders)
        n = len(cards)
        samples: dict[int, list[str]] = {}
        for i in range(n):  # its second: sample where the holder count drops
            if i in pending:
                samples[i] = [pending[i]]
            elif i == n - 1 or cards[i + 1] < cards[i]:
                members = sorted(held[i])  # sorted: set order varies between runs
                samples[i] = self.rng.sample(members, min(self.sample, len(members)))
            else:
                samples[i] = []
        matched = self._walker._walk(len(hashes), cards, samples)
        return Lookup(self.session(session_id), matched)

    def session(self, session_id: str | None) -> str | None:
        entry = self._sessions.get(session_id) if session_id else None
        return entry[0] if entry is not None and entry[1] > self.clock() else None

    def mark_inflight(self, hashes: list[int], replica_id: str, ttl_s: float) -> None:
        """`RedisIndex.mark_inflight`: SET each block's in-flight key with a TTL."""
        expires = self.clock() + ttl_s
        for h in hashes:
            self._inflight.pop(h, None)
            self._inflight[h] = (replica_id, expires)
        _expire(self._inflight, self.clock())

    def remember_session(self, session_id: str, replica_id: str) -> None:
        """`RedisIndex.remember_session`: the session key, TTL renewed on every turn."""
        self._sessions.pop(session_id, None)
        self._sessions[session_id] = (replica_id, self.clock() + self.session_ttl_s)
        _expire(self._sessions, self.clock())


def _expire(entries: dict, now: float) -> None:
    """Drop expired entries from the front (one TTL per dict: insertion order is expiry order)."""
    while entries:
        key = next(iter(entries))
        if entries[key][1] > now:
            return
        del entries[key]
