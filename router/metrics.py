"""Prometheus metrics of routing decisions (registered once per process)."""

from prometheus_client import Counter, Histogram

ROUTE_DECISIONS = Counter(
    "prefixgate_route_decisions_total", "Routing decisions by policy and reason", ["policy", "reason"]
)
ROUTE_MATCHED_BLOCKS = Counter(
    "prefixgate_route_matched_blocks_total", "Leading prompt blocks found on the chosen replica", ["policy"]
)
ROUTE_LATENCY = Histogram(
    "prefixgate_route_decision_seconds",
    "Time to choose a replica, Redis round trip included",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1),
)
INDEX_FAILURES = Counter("prefixgate_index_unavailable_total", "Decisions made without the Redis index")
