"""Gateway metrics: recorded through Ray (exported as ray_prefixgate_* at each node's metrics
export port, tagged with the gateway replica), and also counted in this process's
prometheus_client registry for the gateway's own `/metrics` (one gateway replica's view)."""

import threading
import time
import weakref

from router.telemetry import LATENCY_BUCKETS, Metric

REQUESTS = Metric("counter", "prefixgate_requests", "HTTP API requests by model, endpoint and status", ["model_name", "endpoint", "status"], local=True)
# Per serving replica as the gateway saw them: only in the gateway's own /metrics, since the
# replicas export the same figures through Ray (ray_vllm_prefix_cache_*, ray_vllm_generation_tokens).
PROMPT_TOKENS = Metric("counter", "prefixgate_prefix_cache_queries_tokens", "Prompt tokens looked up in a replica's prefix cache", ["replica"], local=True, ray=False)
CACHED_TOKENS = Metric("counter", "prefixgate_prefix_cache_hits_tokens", "Prompt tokens served from a replica's prefix cache", ["replica"], local=True, ray=False)
COMPLETION_TOKENS = Metric("counter", "prefixgate_completion_tokens", "Generated tokens", ["replica"], local=True, ray=False)
# `replica` is Ray Serve's tag for the recording (gateway) replica, hence serving_replica
ROUTES = Metric("counter", "prefixgate_routed_requests", "Requests by model, serving replica and routing reason", ["model_name", "serving_replica", "reason"], local=True)
TTFT = Metric("histogram", "prefixgate_time_to_first_token_seconds",
              "Time from the gateway receiving a request to its first generated token (routing and queueing included)",
              ["model_name"], buckets=LATENCY_BUCKETS, local=True)
E2E = Metric("histogram", "prefixgate_request_latency_seconds", "Time from arrival at the gateway to the last token", ["model_name"],
             buckets=LATENCY_BUCKETS, local=True)
IN_FLIGHT = Metric("gauge", "prefixgate_in_flight_requests", "Requests admitted by this gateway replica and not finished", local=True)
REJECTED = Metric("counter", "prefixgate_rejected", "Requests refused with 429 because replicas were saturated", local=True)
RETRIES = Metric("counter", "prefixgate_retries", "Requests retried on another replica before any token was sent", local=True)
# A stream moved to another replica after tokens were sent (gateway/migration.py): outcome is
# "resumed" when the new replica continued it, "failed" when no replica could.
MIGRATIONS = Metric("counter", "prefixgate_migrations", "Streams moved to another replica mid-generation, by outcome", ["outcome"], local=True)
# Flow control (gateway/flow/): the queue in front of the replicas. `tenant` is a configured
# tenant ("anonymous" without API keys, "other" for anything else: the label set stays bounded).
QUEUE_DEPTH = Metric("gauge", "prefixgate_queue_depth", "Requests waiting in this gateway's queue, by service tier and tenant",
                     ["model_name", "tier", "tenant"], local=True)
QUEUE_WAIT = Metric("histogram", "prefixgate_queue_wait_seconds",
                    "Time a request waited in the gateway's queue before it was sent (0: sent at once), or refused",
                    ["model_name", "tier", "tenant"], buckets=LATENCY_BUCKETS, local=True)
# reason: queue_full (refused to keep the queue bounded), max_wait (its tier's maximum wait passed),
# disconnected (its client left while it waited; never sent), shutdown, rate_limit (its tenant's rpm/tpm)
SHED_REASONS = ("queue_full", "max_wait", "disconnected", "shutdown", "rate_limit")
SHED = Metric("counter", "prefixgate_shed_requests",
              "Requests refused or dropped before reaching a replica, by model, reason and tenant",
              ["model_name", "reason", "tenant"], local=True)
MIGRATION_RECOMPUTED_TOKENS = Metric("counter", "prefixgate_migration_recomputed_tokens",
                                     "Prompt + already-sent tokens a replica had to take over to continue a moved stream", local=True)


def start(gateway=None, interval_s: float = 1.0) -> None:
    """In the gateway replica at startup: export the counters of rare events at 0, and keep
    re-setting the in-flight gauge from `gateway.in_flight` while the gateway object lives
    (Ray drops a gauge value not refreshed for two export intervals: an idle gateway's 0 would
    vanish from the scrape)."""
    for metric in (REJECTED, RETRIES):
        metric.zero()
    for outcome in ("resumed", "failed"):
        MIGRATIONS.zero(outcome)
    # SHED is exported at 0 per model and tenant by each model's FlowController.start
    if gateway is not None:
        ref = weakref.ref(gateway)

        def refresh() -> None:
            while (gw := ref()) is not None:
                IN_FLIGHT.set(gw.in_flight)
                del gw
                time.sleep(interval_s)

        threading.Thread(target=refresh, name="prefixgate-gauges", daemon=True).start()
