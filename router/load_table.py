"""A router-local copy of the replicas' heartbeats, refreshed in the background.

A routing decision reads load from here instead of from Redis, so its cost does not depend
on the fleet's size; the table costs one pipelined HMGET per replica every `refresh_s`, per
router. A replica whose heartbeat is missing (expired, never written, not read yet) has
*unknown* load: `get` returns None and the router must not treat it as idle. Each read also
feeds the replicas' latency models (router/latency_model.py), refitted here, between decisions.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterable

from router.costs.transfer_model import fleet_rate
from router.index.redis_index import IndexUnavailable, RedisIndex
from router.latency_model import LatencyModels
from router.protocol.redis_schema import LOAD_FIELDS, parse_heartbeat

log = logging.getLogger("prefixgate.router")

REFRESH_CHUNK = 32  # replicas per pipelined round trip of a load-table refresh
_FIELDS = tuple(f.encode() for f in LOAD_FIELDS)

# The rates a policy's `calibrate` takes (keyword -> the heartbeat field replicas measure it in)
MEASURED_RATES = {
    "bytes_per_s": "kv_pull_bytes_per_s",
    "prefill_tokens_per_s": "prefill_tokens_per_s",
    "kv_bytes_per_token": "kv_bytes_per_token",
    "host_bytes_per_s": "kv_host_bytes_per_s",
    "disk_bytes_per_s": "kv_disk_bytes_per_s",
}


class LoadTable:
    def __init__(self, index: RedisIndex, refresh_s: float = 0.1, max_age_s: float = 3.0, seed: int | None = None) -> None:
        self.index = index
        self.refresh_s = refresh_s
        self.max_age_s = max_age_s  # a table not refreshed for this long (Redis away) knows nothing
        self.rng = random.Random(seed)
        self._watched: list[str] = []
        self._live: set[str] = set()
        self._loads: dict[str, dict[str, int]] = {}
        self._pessimistic: tuple[dict, dict[str, int]] | None = None  # (of which table, value)
        self._task: asyncio.Task | None = None
        self._catch_up: asyncio.Task | None = None  # an immediate read for new candidates
        self._hb_keys: dict[str, bytes] = {}
        self.refreshes = 0
        self.updated_at = 0.0
        # each replica's step model, learned from the heartbeats this table reads (router/latency_model.py)
        self.latency = LatencyModels()

    def watch(self, replica_ids: Iterable[str]) -> set[str]:
        """The replicas to keep fresh (the router's current candidates); returns them as a set,
        rebuilt only when they change (a decision must not pay O(fleet) for it)."""
        ids = replica_ids if isinstance(replica_ids, list) else list(replica_ids)
        if ids != self._watched:
            self._watched = list(ids)
            self._live = set(ids)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self._live

    async def include(self, replica_ids: list[str]) -> None:
        """Candidates the table has not read yet (a replacement, a scale-up) are read now,
        once: otherwise the decisions until the next background refresh take them for unknown
        (pessimistic) load, and a burst arriving with a new replica sends it nothing.
        Concurrent callers share one read; costs nothing while the candidates are unchanged."""
        if replica_ids != self._watched:
            new = set(replica_ids) - self._live
            self.watch(replica_ids)
            if new:
                self._catch_up = asyncio.get_running_loop().create_task(self.refresh())
        if self._catch_up is None or self._catch_up.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._catch_up), self.index.config.timeout_s * 2)
        except Exception:  # Redis slow or away: the decision goes on with what the table has
            pass

    def get(self, replica_id: str) -> dict[str, int] | None:
        if time.monotonic() - self.updated_at > self.max_age_s:
            return None
        return self._loads.get(replica_id)

    def sample(self, replica_ids: list[str], k: int, exclude: set[str]) -> list[str]:
        """Up to k random replicas not in `exclude`: the ones scored for load alone."""
        if k <= 0 or not replica_ids:
            return []
        # k + |exclude| distinct draws (O(k), never a scan of the fleet) always leave k others
        n = len(replica_ids)
        draws = self.rng.sample(range(n), min(n, k + len(exclude)))
        return [replica_ids[i] for i in draws if replica_ids[i] not in exclude][:k]

    def measured(self, field: str) -> float | None:
        """The fleet's figure for a rate the replicas measure (heartbeat field, e.g.
        kv_pull_bytes_per_s): the median over the replicas that report one, None if none does."""
        return fleet_rate([v.get(field) for v in self._loads.values()])

    def rates(self) -> dict[str, float | None]:
        """Every measured rate, as `calibrate` keywords (None: no replica measured it yet)."""
        return {name: self.measured(field) for name, field in MEASURED_RATES.items()}

    def pessimistic(self) -> dict[str, int]:
        """Load to assume for a replica whose heartbeat is missing: as busy as the busiest known
        one, plus a queued request (a stalled replica must never look cheapest). Computed once
        per table refresh, not per decision: it scans every replica's load."""
        cached = self._pessimistic
        if cached is not None and cached[0] is self._loads:
            return cached[1]
        value = self._scan_pessimistic()
        self._pessimistic = (self._loads, value)
        return value

    def _scan_pessimistic(self) -> dict[str, int]:
        loads = self._loads.values()
        if not loads:
            return {"running": 0, "waiting": 1, "pending_prefill_tokens": 0}
        return {
            "running": max(v.get("running", 0) for v in loads),
            "waiting": max(v.get("waiting", 0) for v in loads) + 1,
            "pending_prefill_tokens": max(v.get("pending_prefill_tokens", 0) for v in loads),
        }

    async def refresh(self) -> None:
        """One HMGET per watched replica, pipelined in chunks: between chunks the event loop
        runs decisions, which would otherwise wait behind the whole fleet's packing and parsing
        (about 6 ms of CPU at 256 replicas, every refresh)."""
        ids = list(self._watched)
        if not ids:
            return
        client = await self.index._open_guarded()
        deadline = time.monotonic() + max(self.index.config.timeout_s * 10, 0.5)
        keys = self._heartbeat_keys(ids)
        loads = {}
        for start in range(0, len(ids), REFRESH_CHUNK):
            chunk = ids[start : start + REFRESH_CHUNK]
            pipe = client.pipeline(transaction=False)
            for rid in chunk:
                pipe.execute_command("HMGET", keys[rid], *_FIELDS)
            answers = await asyncio.wait_for(pipe.execute(), max(deadline - time.monotonic(), 0.001))
            for rid, values in zip(chunk, answers, strict=True):
                parsed = parse_heartbeat(values)
                if parsed is not None:
                    loads[rid] = parsed
        if ids != self._watched:  # the candidates changed during the read (include()): keep what
            # another read found for the ones this read did not cover
            loads = {**{k: v for k, v in self._loads.items() if k in self._live}, **loads}
        self._loads = loads
        self.refreshes += 1
        self.updated_at = now = time.monotonic()
        self.latency.observe(loads, now)
        self.latency.refit(now)

    def _heartbeat_keys(self, ids: list[str]) -> dict[str, bytes]:
        """Encoded heartbeat key names, made once per replica (kept for the current fleet)."""
        cache = self._hb_keys
        if len(cache) > 2 * len(ids) + 64:  # replicas come and go: forget the departed
            cache.clear()
        for rid in ids:
            if rid not in cache:
                cache[rid] = self.index.keys.heartbeat(rid).encode()
        return cache

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except (IndexUnavailable, Exception) as e:  # keep the last table; unknown stays unknown
                if asyncio.current_task().cancelling():  # a cancel that Python 3.11's wait_for swallowed
                    return
                log.debug("load table refresh failed: %r", e)
            await asyncio.sleep(self.refresh_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=1.0)
