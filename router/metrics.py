"""Metrics of routing decisions, recorded where the router runs (inside each gateway replica):
through Ray (ray_prefixgate_route_* at the node's metrics export port) and into the process's
prometheus_client registry (the gateway's own `/metrics`). See router/telemetry.py."""

from __future__ import annotations

from dataclasses import dataclass

from router.telemetry import Metric


@dataclass
class RouterMetrics:
    decisions: Metric
    matched_blocks: Metric
    latency: Metric
    index_failures: Metric


_metrics: RouterMetrics | None = None


def router_metrics() -> RouterMetrics:
    global _metrics
    if _metrics is None:
        _metrics = RouterMetrics(
            Metric("counter", "prefixgate_route_decisions", "Routing decisions by policy and reason", ["policy", "reason"], local=True),
            Metric("counter", "prefixgate_route_matched_blocks", "Leading prompt blocks found on the chosen replica", ["policy"], local=True),
            Metric("histogram", "prefixgate_route_decision_seconds", "Time to choose a replica, Redis round trip included",
                   buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1), local=True),
            Metric("counter", "prefixgate_index_unavailable", "Decisions made without the Redis index", local=True),
        )
        _metrics.index_failures.zero()  # in every scrape before the first Redis outage
    return _metrics
