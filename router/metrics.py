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
    slo_decisions: Metric
    slo_headroom: Metric


_metrics: RouterMetrics | None = None
SLO_OUTCOMES = ("met", "violated", "cold")
HEADROOM_BUCKETS = (-4.0, -1.0, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def record_slo(metrics: RouterMetrics, objectives, prediction) -> None:
    """A decision for a request with objectives (router/protocol/slo.py Objectives), and the
    chosen replica's prediction (LatencyPrediction, None: no model warm)."""
    if prediction is None:
        metrics.slo_decisions.labels("cold").inc()
        return
    worst = 1.0
    for objective, goal, predicted in (("ttft", objectives.ttft_ms, prediction.ttft_ms),
                                       ("tpot", objectives.tpot_ms, prediction.tpot_ms)):
        if goal is not None:
            headroom = (goal - predicted) / goal
            metrics.slo_headroom.labels(objective).observe(headroom)
            worst = min(worst, headroom)
    metrics.slo_decisions.labels("met" if worst >= 0 else "violated").inc()


def router_metrics() -> RouterMetrics:
    global _metrics
    if _metrics is None:
        _metrics = RouterMetrics(
            Metric("counter", "prefixgate_route_decisions", "Routing decisions by policy and reason", ["policy", "reason"], local=True),
            Metric("counter", "prefixgate_route_matched_blocks", "Leading prompt blocks found on the chosen replica", ["policy"], local=True),
            Metric("histogram", "prefixgate_route_decision_seconds", "Time to choose a replica, Redis round trip included",
                   buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1), local=True),
            Metric("counter", "prefixgate_index_unavailable", "Decisions made without the Redis index", local=True),
            Metric("counter", "prefixgate_route_slo_decisions", "Decisions for requests with latency objectives: the chosen "
                   "replica predicted to meet them (met), none predicted to (violated), no prediction (cold)",
                   ["outcome"], local=True),
            Metric("histogram", "prefixgate_route_slo_headroom", "At decision: (objective - predicted p90) / objective "
                   "on the chosen replica, per objective (below 0: predicted to miss)", ["objective"],
                   buckets=HEADROOM_BUCKETS, local=True),
        )
        _metrics.index_failures.zero()  # in every scrape before the first Redis outage
        for outcome in SLO_OUTCOMES:
            _metrics.slo_decisions.zero(outcome)
            _metrics.slo_decisions.labels(outcome).inc(0)
    return _metrics
