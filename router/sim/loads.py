"""The router's load table over the simulated replicas.

A `LoadTable` whose heartbeats are read from the simulated replicas instead of Redis, so the
Decider samples, scores and reads missing load with the live table's own code (`sample`,
`pessimistic`). Exact by default: every decision sees each replica's load at that instant.
With `refresh_s`, the table is re-read only that often (simulated seconds), as the live one is
refreshed in the background; what a heartbeat lags behind the replica is not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from router.load_table import LoadTable


class Reports(Protocol):
    """A replica whose load the table reads (router/sim/replica.py `SimReplica`)."""

    def heartbeat(self, now: float) -> dict[str, int]: ...


class SimLoadTable(LoadTable):
    def __init__(self, replicas: Mapping[str, Reports], clock: Callable[[], float],
                 refresh_s: float | None = None, seed: int | None = None) -> None:
        super().__init__(None, refresh_s or 0.0, max_age_s=math.inf, seed=seed)  # type: ignore[arg-type]
        self.replicas = replicas
        self.clock = clock
        self.exact = refresh_s is None
        self.updated_at = -math.inf

    def sync(self) -> None:
        """Before a decision: read every replica's load (exact), or once per `refresh_s`."""
        now = self.clock()
        if self.exact or now - self.updated_at >= self.refresh_s:
            self._loads = {rid: rep.heartbeat(now) for rid, rep in self.replicas.items()}
            self.refreshes += 1
            self.updated_at = now

    def watch(self, replica_ids: Iterable[str]) -> set[str]:
        """The live table's, without starting a background refresh (`sync` does it)."""
        ids = replica_ids if isinstance(replica_ids, list) else list(replica_ids)
        if ids != self._watched:
            self._watched = list(ids)
            self._live = set(ids)
        return self._live

    def get(self, replica_id: str) -> dict[str, int] | None:
        return self._loads.get(replica_id)

    async def include(self, replica_ids: list[str]) -> None:
        self.watch(replica_ids)

    async def refresh(self) -> None:
        self.sync()

    async def close(self) -> None:
        return None
