"""Hit-rate ceilings to judge routers against.

Both count leading-block hits in arrival order, with no timing and no in-flight memory:
- unbounded: one cache of infinite size over all traffic; a block hits iff some earlier request
  had it. No router over any number of replicas can do better.
- pooled LRU: one LRU cache holding all replicas' capacity together. A router over N replicas of
  C blocks each has N*C blocks in all; this is what they would hit if they were one cache, so it
  is the fair ceiling for routing (a router can only lose against it, by duplicating blocks or
  by splitting related prompts). Blocks are touched tail first, so a prompt's shared head is
  the most recently used part, as in BlockManager.free. With K/V tiers below the pools, the
  capacity is pools and tiers together (N x (pool + host + disk)): a tier hit counts as a hit.
"""

from __future__ import annotations

from collections import OrderedDict

from router.sim.workload import SimRequest


def unbounded_hits(requests: list[SimRequest]) -> int:
    seen: set[int] = set()
    hits = 0
    for r in requests:
        for h in r.hashes:
            if h not in seen:
                break
            hits += 1
        seen.update(r.hashes)
    return hits


def pooled_lru_hits(requests: list[SimRequest], capacity_blocks: int) -> int:
    lru: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for r in requests:
        for h in r.hashes:
            if h not in lru:
                break
            hits += 1
        for h in reversed(r.hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hits
