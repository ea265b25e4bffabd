"""Prometheus metrics of routing decisions.

Created lazily, on first use in the process where the router actually runs: Ray Serve ships
the router class to every process that holds a handle (cloudpickle may carry module globals
by value), so metric objects made at import time could end up unregistered copies.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY, Counter, Histogram


@dataclass
class RouterMetrics:
    decisions: Counter
    matched_blocks: Counter
    latency: Histogram
    index_failures: Counter


_metrics: RouterMetrics | None = None


def router_metrics() -> RouterMetrics:
    global _metrics
    if _metrics is None:
        existing = getattr(REGISTRY, "_names_to_collectors", {})
        if "prefixgate_route_decisions_total" in existing:  # another copy of this module made them
            _metrics = RouterMetrics(
                existing["prefixgate_route_decisions_total"],
                existing["prefixgate_route_matched_blocks_total"],
                existing["prefixgate_route_decision_seconds"],
                existing["prefixgate_index_unavailable_total"],
            )
        else:
            _metrics = RouterMetrics(
                Counter("prefixgate_route_decisions", "Routing decisions by policy and reason", ["policy", "reason"]),
                Counter("prefixgate_route_matched_blocks", "Leading prompt blocks found on the chosen replica", ["policy"]),
                Histogram(
                    "prefixgate_route_decision_seconds",
                    "Time to choose a replica, Redis round trip included",
                    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1),
                ),
                Counter("prefixgate_index_unavailable", "Decisions made without the Redis index"),
            )
    return _metrics
