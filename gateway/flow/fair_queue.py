"""The queue discipline, pure logic (no clock, no asyncio): which waiting request leaves next,
and which one is refused when the queue is full.

Order: priority band first (rank 0 before 1 before 2), then weighted fair queuing between
tenants inside a band, then, within a tenant, earliest latency deadline first. Each request
costs tokens (its prompt plus the output it may produce: max_tokens); a tenant of weight w is
charged cost / w of virtual time. Start-time tagging as in SFQ: a request's tags are made as
it arrives, in arrival order: its start tag the later of the band's virtual time and its
tenant's previous finish tag, its finish tag start + cost / w. The tenant whose oldest unused
finish tag is the smallest is served next (ties: arrival order). The band's virtual time is the
start tag used last, so a tenant that was idle comes back at the present, neither owed nor
owing, while one that keeps many requests queued has finish tags far ahead: its next request
waits behind the idle tenant's. A lone tenant is served whenever there is room
(work-conserving: the queue never holds a request back for fairness' sake).

Deadlines only choose which of a tenant's own requests takes its turn: the tags say *when* a
tenant is served, exactly as without deadlines; the request that leaves in that turn is the
tenant's queued request with the earliest `due` (arrival + its TTFT objective; requests without
one have none, so they come after the tenant's requests with one, and in arrival order among
themselves). A tenant's requests keep their tags in order of `due` (the i-th request by `due`
holds the i-th tag), so a tenant can reorder its own requests, never take another's turn, and
a queue with no deadlines in it is ordered exactly as before they existed.

Full queue: of the requests queued plus the one arriving, the last (by `due`, then arrival) of
the lowest band's most over-share tenant (its last finish tag furthest ahead of the band's
virtual time) is refused: without deadlines, its newest. That may be the arriving one. Each
request has a deadline (its tier's maximum wait); `expired` takes out those past it, `overdue`
those whose `due` has passed.
"""

from __future__ import annotations

import bisect
import itertools
import math
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
    due: float = math.inf  # its latency deadline (arrival + TTFT objective; inf: none): its order within its tenant
    seq: int = 0  # arrival order, set by push
    queued: bool = False

    @property
    def order(self) -> tuple[float, int]:
        return self.due, self.seq


@dataclass
class _Tenant:
    """One tenant's queued requests in a band: by (due, arrival), and the virtual-time tags
    (start, finish) its requests were charged as they arrived, oldest first; the i-th request
    holds the i-th tag."""

    entries: list[Entry] = field(default_factory=list)
    tags: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, entry: Entry, tag: tuple[float, float]) -> None:
        if not self.entries or self.entries[-1].order < entry.order:
            self.entries.append(entry)  # no deadline (or the latest): O(1), today's FIFO
        else:
            bisect.insort(self.entries, entry, key=lambda e: e.order)
        self.tags.append(tag)

    def take(self, index: int) -> tuple[float, float]:
        """Take out the request at `index` with its tag."""
        del self.entries[index]
        tag = self.tags[index]
        del self.tags[index]
        return tag


@dataclass
class _Band:
    vtime: float = 0.0
    flows: dict[Flow, _Tenant] = field(default_factory=dict)
    last_finish: dict[Flow, float] = field(default_factory=dict)
    size: int = 0

    def head(self) -> Entry | None:
        """The first request of the tenant whose oldest unused tag finishes first."""
        best, key = None, None
        for t in self.flows.values():
            k = (t.tags[0][1], t.entries[0].seq)
            if key is None or k < key:
                best, key = t.entries[0], k
        return best

    def over_share(self) -> Flow:
        """The tenant furthest ahead of the band's virtual time (most over its share)."""
        return max(self.flows, key=lambda f: (self.last_finish[f] - self.vtime, self.flows[f].entries[-1].seq))


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
            for t in band.flows.values():
                yield from t.entries

    def push(self, entry: Entry) -> Entry | None:
        """Queue `entry`; returns the request refused to keep the queue within its capacity
        (possibly `entry` itself), or None."""
        band = self._bands[entry.rank]
        entry.seq = next(self._seq)
        start = max(band.vtime, band.last_finish.get(entry.flow, band.vtime))
        finish = start + entry.cost / max(self.weight(entry.flow), 1e-9)
        band.last_finish[entry.flow] = finish
        band.flows.setdefault(entry.flow, _Tenant()).add(entry, (start, finish))
        band.size += 1
        entry.queued = True
        if len(self) <= self.capacity:
            return None
        victim = self.shed_candidate()
        self.remove(victim)
        return victim

    def shed_candidate(self) -> Entry:
        """The last request (by due, then arrival: without deadlines, the newest) of the lowest
        band's most over-share tenant."""
        band = next(b for b in reversed(self._bands) if b.size)
        return band.flows[band.over_share()].entries[-1]

    def peek(self) -> Entry | None:
        for band in self._bands:
            if band.size:
                return band.head()
        return None

    def pop(self) -> Entry | None:
        entry = self.peek()
        if entry is not None:
            band = self._bands[entry.rank]
            start, _ = self._take(band, entry)
            band.vtime = max(band.vtime, start)
        return entry

    def remove(self, entry: Entry) -> bool:
        """Take out a queued request that will not be served (refused, expired, its client gone)."""
        if not entry.queued:
            return False
        band = self._bands[entry.rank]
        tenant = band.flows[entry.flow]
        last = tenant.entries[-1] is entry
        start, _ = self._take(band, entry)
        if last and band.size:  # it held the tenant's newest tag: that charge goes back
            band.last_finish[entry.flow] = start
        return True

    def expired(self, now: float) -> list[Entry]:
        """Take out and return every request whose deadline has passed."""
        late = [e for e in self if e.deadline <= now]
        for e in late:
            self.remove(e)
        return late

    def overdue(self, now: float, ranks: tuple[int, ...]) -> list[Entry]:
        """Take out and return the requests of bands `ranks` whose `due` has passed: each
        tenant's are the first of its requests, so this reads only those."""
        late = []
        for rank in ranks:
            for tenant in self._bands[rank].flows.values():
                late += itertools.takewhile(lambda e: e.due <= now, tenant.entries)
        for e in late:
            self.remove(e)
        return late

    def depths(self) -> dict[tuple[int, Flow], int]:
        """Queued requests by (band, tenant)."""
        return {(rank, flow): len(t.entries) for rank, band in enumerate(self._bands) for flow, t in band.flows.items()}

    def _take(self, band: _Band, entry: Entry) -> tuple[float, float]:
        """Take `entry` out of its tenant's requests; returns the tag it held."""
        tenant = band.flows[entry.flow]
        index = 0 if tenant.entries[0] is entry else next(i for i, e in enumerate(tenant.entries) if e is entry)
        tag = tenant.take(index)
        if not tenant.entries:
            del band.flows[entry.flow]
        band.size -= 1
        entry.queued = False
        if not band.size:  # the band is idle: nobody is owed or owes anything
            band.vtime = 0.0
            band.last_finish.clear()
        return tag
