"""A replica's heartbeat: its backend's load snapshot, its pulls, and its process facts, as one
typed Heartbeat (router/protocol/redis_schema.py). A field that is not in the struct is a
TypeError here, where the heartbeat is built, not a key that routers silently never read."""

from __future__ import annotations

import collections
import os

from replica.backends.engine_protocol import EngineBackend
from replica.kv_io.pull_load import PullLoad, add_pull_load
from router.protocol.redis_schema import Heartbeat, queued_by_priority


def build_heartbeat(backend: EngineBackend, puller: PullLoad | None,
                    beats: collections.deque[tuple[int, int]] | None = None, handovers_in_flight: int = 0) -> Heartbeat:
    """The heartbeat to write now. `beats` records (steps started, steps finished) per beat: it
    shows that heartbeats go on while a long step runs (tests/test_replica_loop.py).
    `handovers_in_flight`: a decode replica's requests waiting on a prefill replica, not yet in
    its engine: counted as waiting (the router would not see them until their K/V arrived)."""
    s = backend.stats()  # a snapshot: answers at once even during a long step
    if beats is not None:
        beats.append(backend.step_progress())
    load: dict[str, int | float] = {
        "running": s.running,
        "waiting": s.waiting + handovers_in_flight,
        "handovers_in_flight": handovers_in_flight,
        "pending_prefill_tokens": s.pending_prefill_tokens,
        "free_blocks": s.blocks_free,
        "cached_blocks": s.blocks_cached,
        "capacity_blocks": s.blocks_total,
        "kv_pull": int(backend.capabilities.kv_pull),  # routers send pull hints only where 1
        "pid": os.getpid(),
        "generated_tokens": s.generated_tokens,
        "lora_resident": " ".join(s.lora_resident),
        "lora_load_ms": round(s.lora_load_s * 1000),
        "context_tokens": s.context_tokens,
        "step_token_budget": s.step_token_budget,
        "queued_by_priority": queued_by_priority(s.queued_by_priority),
        **s.step_totals.heartbeat(),  # what the router's latency model learns from
    }
    for medium, tier in s.tiers.items():  # the K/V tiers below the pool
        load[f"{medium}_blocks"] = tier.blocks
        load[f"{medium}_capacity_blocks"] = tier.capacity_blocks
        load[f"kv_{medium}_bytes_per_s"] = tier.promotion_bytes_per_s
    extra = backend.load_extra()
    rates = {k: extra.pop(k) for k in ("kv_pull_bytes_per_s", "prefill_tokens_per_s") if k in extra}
    load.update(extra)
    return Heartbeat(**add_pull_load(load, puller, backend.facts.kv_bytes_per_token, rates or None))
