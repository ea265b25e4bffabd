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
# disconnected (its client left while it waited; never sent), shutdown, rate_limit (its tenant's rpm/tpm),
# slo (a latency objective it cannot meet: prefixgate_slo_shed has the detail)
SHED_REASONS = ("queue_full", "max_wait", "disconnected", "shutdown", "rate_limit", "slo")
SHED = Metric("counter", "prefixgate_shed_requests",
              "Requests refused or dropped before reaching a replica, by model, reason and tenant",
              ["model_name", "reason", "tenant"], local=True)
MIGRATION_RECOMPUTED_TOKENS = Metric("counter", "prefixgate_migration_recomputed_tokens",
                                     "Prompt + already-sent tokens a replica had to take over to continue a moved stream", local=True)

# Latency objectives (gateway/flow/slo.py, judged by gateway/slo_watch.py): requests that carried
# any objective, how many had and met each (`objective`: ttft, tpot, both: had both and met both),
# the goodput counter (met every objective it had: rate() is goodput), and observed / objective.
# `tenant` as the queue's metrics (a configured tenant, or anonymous without API keys).
SLO_OBJECTIVES = ("ttft", "tpot", "both")
SLO_REQUESTS = Metric("counter", "prefixgate_slo_requests", "Requests with a latency objective, judged when they finished "
                      "or failed", ["model_name", "tenant", "tier"], local=True)
SLO_HAD = Metric("counter", "prefixgate_slo_objectives", "Requests that had this objective (both: had both): "
                 "the denominator of prefixgate_slo_met", ["model_name", "tenant", "tier", "objective"], local=True)
SLO_MET = Metric("counter", "prefixgate_slo_met", "Requests that met this objective (both: had and met both)",
                 ["model_name", "tenant", "tier", "objective"], local=True)
SLO_GOODPUT = Metric("counter", "prefixgate_slo_goodput_requests", "Requests that met every objective they had "
                     "(rate(): goodput)", ["model_name", "tenant", "tier"], local=True)
# observed / objective: 1 is exactly on it, below 1 met
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 100.0)
SLO_RATIO = Metric("histogram", "prefixgate_slo_observed_ratio", "Observed TTFT or TPOT / the request's objective",
                   ["model_name", "tier", "objective"], buckets=RATIO_BUCKETS, local=True)

# the router's p90 prediction for the chosen replica (router/latency_model.py) against what the
# gateway observed, from the routing call on: covered / predictions is the p90's coverage
PREDICTED_OBJECTIVES = ("ttft", "tpot")
SLO_PREDICTIONS = Metric("counter", "prefixgate_slo_predictions", "Requests with objectives whose routing decision "
                         "carried a p90 prediction, judged against the observed TTFT or TPOT",
                         ["model_name", "objective"], local=True)
SLO_COVERED = Metric("counter", "prefixgate_slo_prediction_covered", "Of prefixgate_slo_predictions, those observed "
                     "at or under the p90 predicted at decision (the quantile's coverage: aim 0.85-0.95)",
                     ["model_name", "objective"], local=True)
SLO_PREDICTION_RATIO = Metric("histogram", "prefixgate_slo_prediction_ratio", "Observed TTFT or TPOT / the p90 "
                              "predicted at decision (the prediction's error; at most 1: covered)",
                              ["model_name", "objective"], buckets=RATIO_BUCKETS, local=True)

# requests shed for a TTFT objective they cannot meet (gateway/flow/slo_admission.py): reason
# predicted (the best prediction says so as it was about to be sent) or expired (its deadline
# passed in the queue); only the tiers that are shed (priority never is)
SLO_SHED_TIERS = ("default", "flex")
SLO_SHED_REASONS = ("predicted", "expired")
SLO_SHED = Metric("counter", "prefixgate_slo_shed", "Requests refused with 429 for a time-to-first-token objective "
                  "they could not meet (predicted: on no replica; expired: its deadline passed in the queue)",
                  ["model_name", "tenant", "tier", "reason"], local=True)


def zero_slo(model: str, tenants: tuple[str, ...], tiers: tuple[str, ...]) -> None:
    """Every SLO counter at 0 for the label values known at start (models, tiers, tenants), in
    Ray's export and in this process's /metrics, so the dashboard's panels have data before the
    first request with an objective. The ratio histogram appears with its first observation."""
    for tenant in tenants:
        for tier in tiers:
            for metric, extra in ((SLO_REQUESTS, ()), (SLO_GOODPUT, ()),
                                  *((m, (o,)) for m in (SLO_HAD, SLO_MET) for o in SLO_OBJECTIVES)):
                metric.zero(model, tenant, tier, *extra)  # Ray's export
                metric.labels(model, tenant, tier, *extra).inc(0)  # this process's registry
            if tier in SLO_SHED_TIERS:
                for reason in SLO_SHED_REASONS:
                    SLO_SHED.zero(model, tenant, tier, reason)
                    SLO_SHED.labels(model, tenant, tier, reason).inc(0)
    for objective in PREDICTED_OBJECTIVES:
        for metric in (SLO_PREDICTIONS, SLO_COVERED):
            metric.zero(model, objective)
            metric.labels(model, objective).inc(0)


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
