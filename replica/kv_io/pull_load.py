"""What a replica's heartbeat carries for the router's pull pricing (docs/kv-pull.md).

Torch-free, so a sim replica (which never loads torch) writes its heartbeat through it too.
Every key written here must be a field of router/protocol/redis_schema.py's Heartbeat, or the
publisher drops it and calibration silently falls back to defaults (tests/test_kv_pull.py).
"""

from __future__ import annotations

from typing import Protocol


class PullLoad(Protocol):
    """The part of replica/kv_io/kv_pull.py's KvPuller this reads."""

    in_flight: int
    in_flight_tokens: int

    def heartbeat(self) -> dict[str, int]: ...


def add_pull_load(
    load: dict[str, int],
    puller: PullLoad | None,
    kv_bytes_per_token: int = 0,
    modelled_rates: dict[str, int] | None = None,
) -> dict[str, int]:
    """Complete a heartbeat load: the measured (or, on a sim engine, modelled) rates and the K/V
    size per token. Pulls in flight count as waiting requests with their whole prompts pending,
    or the router would not see them until their pull ends (up to the pull timeout)."""
    if puller is not None:
        load.update(puller.heartbeat())
        load["waiting"] = load.get("waiting", 0) + puller.in_flight
        load["pending_prefill_tokens"] = load.get("pending_prefill_tokens", 0) + puller.in_flight_tokens
    if kv_bytes_per_token:
        load["kv_bytes_per_token"] = kv_bytes_per_token
    if modelled_rates is not None:
        load.update(modelled_rates)
    return load
