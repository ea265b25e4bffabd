"""The queue discipline, pure logic (no clock, no asyncio): which waiting request leaves next,
and which one is refused when the queue is full.

Order: priority band first (rank 0 before 1 before 2), then weighted fair queuing between
tenants inside a band, FIFO within a tenant. Each request costs tokens (its prompt plus the
output it may produce: max_tokens); a tenant of weight w is charged cost / w of virtual time.
Start-time tagging as in SFQ: a request's start tag is the later of the band's virtual time
and its tenant's previous finish tag, its finish tag start + cost / w, and the request with
the smallest finish tag leaves first (ties: arrival order). The band's virtual time is the
start tag of the request that left last, so a tenant that was idle comes back at the present,
neither owed nor owing, while one that keeps many requests queued has finish tags far ahead:
its next request waits behind the idle tenant's. A lone tenant is served whenever there is
room (work-conserving: the queue never holds a request back for fairness' sake).

Full queue: of the requests queued plus the one arriving, the newest of the lowest band's
most over-share tenant (its last finish tag furthest ahead of the band's virtual time) is
refused. That may be the arriving one. Each request has a deadline (its tier's maximum wait);
`expired` takes out those past it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

Flow = str | None  # a tenant (None: no API keys configured, one shared flow)


@dataclass(eq=False)
class Entry:
    rank: int  # priority band, 0 served first
    flow: Flow
    cost: float  # tokens: prompt + expected output
    deadline: float = float("inf")  # past it the request is refused (its tier's maximum wait)
    payload: Any = None
    seq: int = 0  # arrival order, set by push
    start: float = 0.0  # virtual start tag
    finish: float = 0.0  # virtual finish tag
    queued: bool = False


@dataclass
class _Band:
    vtime: float = 0.0
    flows: dict[Flow, deque[Entry]] = field(default_factory=dict)
    last_finish: dict[Flow, float] = field(default_factory=dict)
    size: int = 0

    def head(self) -> Entry | None:
        best = None
        for q in self.flows.values():
            e = q[0]
            if best is None or (e.finish, e.seq) < (best.finish, best.seq):
                best = e
        return best

    def over_share(self) -> Flow:
        """The tenant furthest ahead of the band's virtual time (most over its share)."""
        return max(self.flows, key=lambda f: (self.last_finish[f] - self.vtime, self.flows[f][-1].seq))


class FairQueue:
    def __init__(self, capacity: int, weight: Callable[[Flow], float] | None = None, bands: int = 3) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self.weight = weight or (lambda _flow: 1.0)
        self._bands = [_Band() for _ in range(bands)]
        self._seq = itertools.count()

    def __len__(self) -> int:
        return sum(b.size for b in self._bands)

    def __iter__(self) -> Iterator[Entry]:
        for band in self._bands:
            for q in band.flows.values():
                yield from q

    def push(self, entry: Entry) -> Entry | None:
        """Queue `entry`; returns the request refused to keep the queue within its capacity
        (possibly `entry` itself), or None."""
        band = self._bands[entry.rank]
        entry.seq = next(self._seq)
        entry.start = max(band.vtime, band.last_finish.get(entry.flow, band.vtime))
        entry.finish = entry.start + entry.cost / max(self.weight(entry.flow), 1e-9)
        band.last_finish[entry.flow] = entry.finish
        band.flows.setdefault(entry.flow, deque()).append(entry)
        band.size += 1
        entry.queued = True
        if len(self) <= self.capacity:
            return None
        victim = self.shed_candidate()
        self.remove(victim)
        return victim

    def shed_candidate(self) -> Entry:
        """The newest request of the lowest band's most over-share tenant."""
        band = next(b for b in reversed(self._bands) if b.size)
        return band.flows[band.over_share()][-1]

    def peek(self) -> Entry | None:
        for band in self._bands:
            if band.size:
                return band.head()
        return None

    def pop(self) -> Entry | None:
        entry = self.peek()
        if entry is not None:
            band = self._bands[entry.rank]
            band.vtime = max(band.vtime, entry.start)
            self._take(band, entry)
        return entry

    def remove(self, entry: Entry) -> bool:
        """Take out a queued request that will not be served (refused, expired, its client gone)."""
        if not entry.queued:
            return False
        band = self._bands[entry.rank]
        q = band.flows[entry.flow]
        if q[-1] is entry:  # the tenant's newest: its charge goes back
            band.last_finish[entry.flow] = entry.start
        self._take(band, entry)
        return True

    def expired(self, now: float) -> list[Entry]:
        """Take out and return every request whose deadline has passed."""
        late = [e for e in self if e.deadline <= now]
        for e in late:
            self.remove(e)
        return late

    def depths(self) -> dict[tuple[int, Flow], int]:
        """Queued requests by (band, tenant)."""
        return {(rank, flow): len(q) for rank, band in enumerate(self._bands) for flow, q in band.flows.items()}

    def _take(self, band: _Band, entry: Entry) -> None:
        q = band.flows[entry.flow]
        if q[0] is entry:
            q.popleft()
        else:
            q.remove(entry)
        if not q:
            del band.flows[entry.flow]
        band.size -= 1
        entry.queued = False
        if not band.size:  # the band is idle: nobody is owed or owes anything
            band.vtime = 0.0
            band.last_finish.clear()
