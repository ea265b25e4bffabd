"""Writes infra/grafana/prefixgate.json, the prefixgate Grafana dashboard:

    .venv/bin/python infra/grafana/build_dashboard.py > infra/grafana/prefixgate.json

Every query reads what the stack exports through Ray (ray_vllm_* from the replicas under vLLM's
names, ray_prefixgate_* from the gateway and router); tests/test_metrics.py checks each one
against a scrape of a running stack, and that the JSON matches this script.
"""

from __future__ import annotations

import json
import sys

M = 'model_name=~"$model"'
RATE = "[$interval]"


def q(quantile: float, metric: str, by: str = "", selector: str = "") -> str:
    return (f"histogram_quantile({quantile}, sum by (le{', ' + by if by else ''}) "
            f"(rate({metric}_bucket{{{selector}}}{RATE})))")


# (row title, [(panel title, unit, description, [(expr, legend)])])
ROWS = [
    ("Prefix cache and routing", [
        ("Prefix cache hit rate, all replicas", "percentunit",
         "Prompt tokens served from a replica's prefix cache / prompt tokens: what routing buys.",
         [(f"sum(rate(ray_vllm_prefix_cache_hits_total{{{M}}}{RATE})) / sum(rate(ray_vllm_prefix_cache_queries_total{{{M}}}{RATE}))", "hit rate")]),
        ("Prefix cache hit rate per replica", "percentunit", "",
         [(f"sum by (replica) (rate(ray_vllm_prefix_cache_hits_total{{{M}}}{RATE})) / sum by (replica) (rate(ray_vllm_prefix_cache_queries_total{{{M}}}{RATE}))", "{{replica}}")]),
        ("Routing decisions by reason", "reqps",
         "prefix: cached blocks found; session: sticky session; load: balance won; fallback: no Redis index.",
         [(f"sum by (policy, reason) (rate(ray_prefixgate_route_decisions_total{RATE}))", "{{policy}} / {{reason}}")]),
        ("Requests by serving replica and reason", "reqps", "",
         [(f"sum by (serving_replica, reason) (rate(ray_prefixgate_routed_requests_total{RATE}))", "{{serving_replica}} / {{reason}}")]),
        ("Decision latency", "s", "Time to choose a replica, Redis round trip included.",
         [(q(0.5, "ray_prefixgate_route_decision_seconds"), "p50"), (q(0.99, "ray_prefixgate_route_decision_seconds"), "p99")]),
        ("Matched blocks per decision, index failures", "short",
         "Leading prompt blocks found on the chosen replica per decision; decisions made without Redis per second.",
         [(f"sum(rate(ray_prefixgate_route_matched_blocks_total{RATE})) / sum(rate(ray_prefixgate_route_decisions_total{RATE}))", "matched blocks / decision"),
          (f"sum(rate(ray_prefixgate_index_unavailable_total{RATE}))", "index unavailable / s")]),
    ]),
    ("Latency", [
        ("Time to first token (replica)", "s", "Arrival at the replica to the first token.",
         [(q(x, "ray_vllm_time_to_first_token_seconds", selector=M), f"p{int(x * 100)}") for x in (0.5, 0.9, 0.99)]),
        ("Inter-token latency", "s", "Time between two successive output tokens of a request.",
         [(q(x, "ray_vllm_inter_token_latency_seconds", selector=M), f"p{int(x * 100)}") for x in (0.5, 0.9, 0.99)]),
        ("Time to first token (gateway)", "s", "What clients feel: routing and queueing included.",
         [(q(x, "ray_prefixgate_time_to_first_token_seconds"), f"p{int(x * 100)}") for x in (0.5, 0.9, 0.99)]),
        ("Queue time per replica, p90", "s", "Arrival at the replica to first scheduled.",
         [(q(0.9, "ray_vllm_request_queue_time_seconds", by="replica", selector=M), "{{replica}}")]),
    ]),
    ("Load", [
        ("Running requests per replica", "short", "",
         [(f"sum by (replica) (ray_vllm_num_requests_running{{{M}}})", "{{replica}}")]),
        ("Waiting requests per replica", "short", "",
         [(f"sum by (replica) (ray_vllm_num_requests_waiting{{{M}}})", "{{replica}}")]),
        ("KV cache usage per replica", "percentunit", "Blocks held by requests / all blocks (cached free blocks count as free).",
         [(f"max by (replica) (ray_vllm_kv_cache_usage_perc{{{M}}})", "{{replica}}")]),
        ("Tokens per second", "short", "",
         [(f"sum(rate(ray_vllm_generation_tokens_total{{{M}}}{RATE}))", "generated"),
          (f"sum(rate(ray_vllm_prompt_tokens_total{{{M}}}{RATE}))", "prompt")]),
        ("Requests in flight at the gateways", "short", "Admitted and not finished, all gateway replicas.",
         [("sum(ray_prefixgate_in_flight_requests)", "in flight")]),
        ("Preemptions", "short", "Requests whose blocks were freed to make room (recomputed later).",
         [(f"sum by (replica) (rate(ray_vllm_num_preemptions_total{{{M}}}{RATE}))", "{{replica}}")]),
    ]),
    ("K/V tiers below the pool", [
        ("Tier occupancy", "percentunit", "Blocks held / capacity of the host and disk tiers, all replicas (0 for a tier not configured).",
         [(f"sum by (medium) (ray_prefixgate_kv_tier_blocks{{{M}}}) / clamp_min(sum by (medium) (ray_prefixgate_kv_tier_capacity_blocks{{{M}}}), 1)", "{{medium}}")]),
        ("Promotions and demotions", "short", "Blocks per second moved back into the pool (hits) and down into each tier.",
         [(f"sum by (medium) (rate(ray_prefixgate_kv_tier_promotions_total{{{M}}}{RATE}))", "promoted from {{medium}}"),
          (f"sum by (medium) (rate(ray_prefixgate_kv_tier_demotions_total{{{M}}}{RATE}))", "demoted to {{medium}}"),
          (f"sum by (medium) (rate(ray_prefixgate_kv_tier_dropped_total{{{M}}}{RATE}))", "dropped from {{medium}}")]),
        ("Tier hits and bytes moved", "Bps", "Prompt tokens per second served from each tier, and K/V bytes per second copied.",
         [(f"sum by (medium) (rate(ray_prefixgate_kv_tier_hit_tokens_total{{{M}}}{RATE}))", "hit tokens / s {{medium}}"),
          (f"sum by (medium, direction) (rate(ray_prefixgate_kv_tier_bytes_total{{{M}}}{RATE}))", "{{medium}} {{direction}}")]),
    ]),
    ("Flow control (docs/flow-control.md)", [
        ("Queued requests by tier and tenant", "short",
         "Requests waiting in the gateways' queues (flow_control on), per model, service tier and tenant.",
         [(f"sum by (model_name, tier, tenant) (ray_prefixgate_queue_depth{{{M}}})", "{{model_name}} {{tier}} {{tenant}}")]),
        ("Queue wait p99 by tier", "s", "Time from arrival to being sent to a replica (0 when sent at once).",
         [(q(0.99, "ray_prefixgate_queue_wait_seconds", "tier", M), "{{tier}}")]),
        ("Shed requests by reason", "reqps",
         "Refused or dropped before reaching a replica: queue_full, max_wait, disconnected, shutdown, rate_limit, slo "
         "(a latency objective it could not meet).",
         [(f"sum by (reason) (rate(ray_prefixgate_shed_requests_total{RATE}))", "{{reason}}")]),
    ]),
    ("Latency objectives (docs/flow-control.md)", [
        ("Objectives met, by objective", "percentunit",
         "Requests that met their x-slo-ttft-ms / x-slo-tpot-ms objective (header, API key or tier default) / requests "
         "that had it; both: had and met both. Routing acts on them (the `slo` policy), the queue orders and sheds by TTFT.",
         [(f"sum by (objective) (rate(ray_prefixgate_slo_met_total{{{M}}}{RATE})) / "
           f"sum by (objective) (rate(ray_prefixgate_slo_objectives_total{{{M}}}{RATE}))", "{{objective}}")]),
        ("Goodput", "reqps", "Requests per second that met every objective they had, beside all requests with objectives.",
         [(f"sum by (model_name) (rate(ray_prefixgate_slo_goodput_requests_total{{{M}}}{RATE}))", "goodput {{model_name}}"),
          (f"sum by (model_name) (rate(ray_prefixgate_slo_requests_total{{{M}}}{RATE}))", "with objectives {{model_name}}")]),
        ("Objectives met, by tier and tenant", "percentunit", "Goodput / requests with objectives, per service tier and tenant.",
         [(f"sum by (tier, tenant) (rate(ray_prefixgate_slo_goodput_requests_total{{{M}}}{RATE})) / "
           f"sum by (tier, tenant) (rate(ray_prefixgate_slo_requests_total{{{M}}}{RATE}))", "{{tier}} {{tenant}}")]),
        ("Observed / objective", "short", "Observed TTFT and TPOT over the request's objective (1: exactly on it; above: missed).",
         [(q(x, "ray_prefixgate_slo_observed_ratio", "objective", M), f"p{int(x * 100)} {{{{objective}}}}") for x in (0.5, 0.9)]),
        ("Latency model: p90 coverage", "percentunit",
         "Requests whose observed TTFT / TPOT (from the routing call) was at or under the p90 the router predicted for "
         "the chosen replica at decision / requests judged with a prediction. Aim 0.85-0.95: lower, the model is "
         "optimistic; higher, it wastes headroom. Error: prefixgate_slo_prediction_ratio (docs/metrics.md).",
         [(f"sum by (objective) (rate(ray_prefixgate_slo_prediction_covered_total{{{M}}}{RATE})) / "
           f"sum by (objective) (rate(ray_prefixgate_slo_predictions_total{{{M}}}{RATE}))", "{{objective}}")]),
        ("Routing with objectives: predicted outcome", "reqps",
         "Decisions for requests with objectives: the chosen replica predicted to meet them (met), none predicted to "
         "(violated: the least violation was chosen), or no warm latency model (cold: today's costs chose). "
         "Headroom at decision: prefixgate_route_slo_headroom (docs/metrics.md).",
         [(f"sum by (outcome) (rate(ray_prefixgate_route_slo_decisions_total{RATE}))", "{{outcome}}")]),
        ("Shed for a TTFT objective", "reqps",
         "default and flex requests refused with 429 for an x-slo-ttft-ms objective: predicted (no replica's p90 could "
         "meet it as it was about to be sent) or expired (its deadline passed in the queue). Priority requests are "
         "never shed for it; slo_shed=false: none.",
         [(f"sum by (tier, reason) (rate(ray_prefixgate_slo_shed_total{{{M}}}{RATE}))", "{{tier}} {{reason}}")]),
    ]),
    ("Errors and recovery", [
        ("429s (replicas saturated)", "reqps", "",
         [(f"sum(rate(ray_prefixgate_rejected_total{RATE}))", "429 / s")]),
        ("HTTP responses by status", "reqps", "",
         [(f"sum by (endpoint, status) (rate(ray_prefixgate_requests_total{RATE}))", "{{endpoint}} {{status}}")]),
        ("Retries and migrations", "reqps",
         "Retries: a replica failed before the first token. Migrations: a stream moved to another replica mid-generation.",
         [(f"sum(rate(ray_prefixgate_retries_total{RATE}))", "retries"),
          (f"sum by (outcome) (rate(ray_prefixgate_migrations_total{RATE}))", "migrations {{outcome}}")]),
        ("Finished requests by reason", "reqps", "",
         [(f"sum by (finished_reason) (rate(ray_vllm_request_success_total{{{M}}}{RATE}))", "{{finished_reason}}")]),
    ]),
]


def build() -> dict:
    panels: list[dict] = []
    pid, y = 1, 0
    for title, row in ROWS:
        panels.append({"type": "row", "title": title, "id": pid, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, (ptitle, unit, desc, targets) in enumerate(row):
            panels.append({
                "type": "timeseries", "title": ptitle, "id": pid, "description": desc,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "targets": [{"expr": e, "legendFormat": leg, "refId": chr(65 + k)} for k, (e, leg) in enumerate(targets)],
            })
            pid += 1
        y += 8 * ((len(row) + 2) // 3)
    variables = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
        {"name": "model", "label": "Model", "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "definition": "label_values(ray_vllm_num_requests_running, model_name)",
         "query": {"query": "label_values(ray_vllm_num_requests_running, model_name)", "refId": "model"},
         "refresh": 2, "includeAll": True, "allValue": ".*", "multi": True,
         "current": {"text": ["All"], "value": ["$__all"]}},
        {"name": "interval", "label": "Rate window", "type": "custom", "query": "1m,5m,15m",
         "current": {"text": "5m", "value": "5m"},
         "options": [{"text": v, "value": v, "selected": v == "5m"} for v in ("1m", "5m", "15m")]},
    ]
    return {
        "title": "prefixgate", "uid": "prefixgate", "editable": True, "schemaVersion": 39, "version": 1,
        "tags": ["prefixgate", "ray", "vllm"], "time": {"from": "now-30m", "to": "now"}, "refresh": "10s",
        "templating": {"list": variables}, "panels": panels, "annotations": {"list": []},
    }


if __name__ == "__main__":
    json.dump(build(), sys.stdout, indent=2)
    sys.stdout.write("\n")
