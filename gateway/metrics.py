"""Gateway metrics (Prometheus text at /metrics). The router's metrics share this registry,
since Ray Serve runs the replica router inside the gateway's process."""

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("prefixgate_requests_total", "HTTP API requests by endpoint and status", ["endpoint", "status"])
PROMPT_TOKENS = Counter("prefixgate_prefix_cache_queries_tokens_total", "Prompt tokens looked up in a replica's prefix cache", ["replica"])
CACHED_TOKENS = Counter("prefixgate_prefix_cache_hits_tokens_total", "Prompt tokens served from a replica's prefix cache", ["replica"])
COMPLETION_TOKENS = Counter("prefixgate_completion_tokens_total", "Generated tokens", ["replica"])
ROUTES = Counter("prefixgate_routed_requests_total", "Requests by serving replica and routing reason", ["replica", "reason"])
TTFT = Histogram(
    "prefixgate_time_to_first_token_seconds",
    "Time from request arrival to the first generated token",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
E2E = Histogram(
    "prefixgate_request_latency_seconds", "Time from arrival to the last token",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
IN_FLIGHT = Gauge("prefixgate_in_flight_requests", "Requests admitted and not finished")
REJECTED = Counter("prefixgate_rejected_total", "Requests refused with 429 because replicas were saturated")
RETRIES = Counter("prefixgate_retries_total", "Requests retried on another replica before any token was sent")
