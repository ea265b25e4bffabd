"""Metrics through Ray: vLLM's names from the replicas, ours from the gateway and router, and
every query of our Grafana dashboard and of Ray's Serve LLM dashboard against a real scrape.

The stack test sends traffic, then scrapes the local Ray node's metrics export port (the
stack's --metrics-port) until the names appear (Ray's agents export on an interval).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from replica.core.request_metrics import RequestMetrics
from replica.serve.metrics import token_buckets
from tests.helpers.metrics import (
    Series,
    our_dashboard_queries,
    ray_serve_llm_queries,
    scrape,
    total,
)
from tests.helpers.prometheus_live import LivePrometheus
from tests.helpers.promql import parse

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a careful assistant for a travel agency. Answer in one short sentence. " * 4

# What Ray's Serve LLM dashboard and vLLM-keyed autoscalers read (NIXL and KV offload aside)
VLLM_NAMES = [
    "ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting", "ray_vllm_num_requests_swapped",
    "ray_vllm_kv_cache_usage_perc", "ray_vllm_prefix_cache_queries_total", "ray_vllm_prefix_cache_hits_total",
    "ray_vllm_prompt_tokens_total", "ray_vllm_generation_tokens_total", "ray_vllm_request_success_total",
    "ray_vllm_num_preemptions_total",
    *(f"{h}_{s}" for h in (
        "ray_vllm_time_to_first_token_seconds", "ray_vllm_inter_token_latency_seconds",
        "ray_vllm_request_time_per_output_token_seconds", "ray_vllm_e2e_request_latency_seconds",
        "ray_vllm_request_queue_time_seconds", "ray_vllm_request_prefill_time_seconds",
        "ray_vllm_request_decode_time_seconds", "ray_vllm_request_inference_time_seconds",
        "ray_vllm_request_prompt_tokens", "ray_vllm_request_generation_tokens",
    ) for s in ("bucket", "sum", "count")),
]
OUR_NAMES = [
    "ray_prefixgate_route_decisions_total", "ray_prefixgate_route_matched_blocks_total",
    "ray_prefixgate_route_decision_seconds_bucket", "ray_prefixgate_index_unavailable_total",
    "ray_prefixgate_requests_total", "ray_prefixgate_routed_requests_total",
    "ray_prefixgate_time_to_first_token_seconds_bucket", "ray_prefixgate_request_latency_seconds_bucket",
    "ray_prefixgate_in_flight_requests", "ray_prefixgate_rejected_total", "ray_prefixgate_retries_total",
    "ray_prefixgate_migrations_total",
    # latency objectives (gateway/slo_watch.py): counters at 0 from start-up, the ratio once a request had one
    "ray_prefixgate_slo_requests_total", "ray_prefixgate_slo_objectives_total", "ray_prefixgate_slo_met_total",
    "ray_prefixgate_slo_goodput_requests_total", "ray_prefixgate_slo_observed_ratio_bucket",
]
# Set by KubeRay's PodMonitor, not by Ray itself; the dashboard's "All" matches its absence
NOT_OURS_LABELS = {"ray_io_cluster"}


# ---- pure pieces ------------------------------------------------------------------------------
def test_promql_names_and_labels():
    q = parse('histogram_quantile(0.9, sum by (le, WorkerId) (rate(ray_vllm_ttft_bucket{model_name=~"$m", a="b"}[$interval])))'
              ' * on(WorkerId) group_left(deployment, replica) max by(WorkerId) (ray_serve_c_total{x=~".*"} * 0 + 1e3)')
    assert q.metrics == {"ray_vllm_ttft_bucket", "ray_serve_c_total"}
    assert q.grouping_labels == {"le", "WorkerId", "deployment", "replica"}
    assert q.required_labels == {("ray_vllm_ttft_bucket", "a")}  # match-all regexes need nothing
    v = parse("label_values(ray_vllm_request_prompt_tokens_sum{}, WorkerId)")
    assert v.metrics == {"ray_vllm_request_prompt_tokens_sum"}
    assert v.required_labels == {("ray_vllm_request_prompt_tokens_sum", "WorkerId")}
    assert parse("max_over_time(sum by (model_name) (rate(x_total[2m]))[24h:1m]) and bool y").metrics == {"x_total", "y"}


def test_request_intervals_follow_vllm():
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=13.0,
                       num_prompt_tokens=40, num_cached_tokens=32, num_generation_tokens=5)
    assert (m.queue_time, m.prefill_time, m.decode_time, m.inference_time, m.e2e_time) == (0.5, 0.5, 2.0, 2.5, 3.0)
    assert m.ttft == 1.0 and m.time_per_output_token == 0.5
    one = RequestMetrics(10.0, None, None, 12.0, 4, 0, 0)  # finished without ever running
    assert one.queue_time == 2.0 and one.ttft is None and one.time_per_output_token is None
    assert token_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


def test_dashboard_json_is_what_the_script_builds():
    built = subprocess.run([sys.executable, str(ROOT / "infra/grafana/build_dashboard.py")],
                           capture_output=True, text=True, check=True).stdout
    assert json.loads(built) == json.loads((ROOT / "infra/grafana/prefixgate.json").read_text()), \
        "regenerate: python infra/grafana/build_dashboard.py > infra/grafana/prefixgate.json"


# ---- dashboards' queries ----------------------------------------------------------------------
def test_dashboards_have_queries():
    ours, rays = our_dashboard_queries(), ray_serve_llm_queries()
    assert len(ours) >= 20 and len(rays) >= 40, (len(ours), len(rays))
    assert any("ray_vllm_prefix_cache_hits_total" in q for q in rays)


# ---- the running stack --------------------------------------------------------------------------
def _chat(url: str, messages: list[dict], session: str, headers: dict[str, str] | None = None, **kw) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": session, **(headers or {})},
                      timeout=180)


def _wait_for_series(prom: LivePrometheus, expr: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s  # Ray exports about every 10 s, Prometheus scrapes every 3 s
    while not prom.query(expr):
        assert time.monotonic() < deadline, f"Prometheus has no {expr} after {timeout_s:.0f} s"
        time.sleep(1)


@pytest.fixture(scope="module")
def live_prometheus(stack):
    """A real Prometheus scraping the stack's Ray metrics port every 3 s, from before the traffic."""
    prom = LivePrometheus(stack.metrics_port).start()
    yield prom
    prom.stop()


@pytest.fixture(scope="module")
def traffic_scrape(stack, live_prometheus):
    """Two-turn sessions (second turns hit the cache), then the scrape once everything is in."""
    import ray

    ports = {n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]}
    assert ports == {stack.metrics_port}, (ports, stack.metrics_port)  # --metrics-port reached Ray
    before = scrape(stack.metrics_port)
    sent, served_by = 0, set()
    for i in range(3):
        session = f"metrics-{uuid.uuid4().hex[:6]}"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Suggest a city, number {i}."}]
        for turn in range(2):
            if sent == 1:
                # Prometheus's rate() ignores a series' first sample (histograms appear on their
                # first observation): let it see the first request's before the rest arrive
                _wait_for_series(live_prometheus, 'ray_vllm_time_to_first_token_seconds_count{application="prefixgate"}')
            r = _chat(stack.url, messages, session)
            assert r.status_code == 200, r.text
            sent += 1
            served_by.add(r.headers["x-prefixgate-replica"])
            messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"And another one, turn {turn}?"}]
    # a streamed one too, with latency objectives (one hour each: met) for the SLO panels
    r = _chat(stack.url, messages[:2], "metrics-stream", {"x-slo-ttft-ms": "3600000", "x-slo-tpot-ms": "3600000"},
              stream=True)
    assert r.status_code == 200 and "[DONE]" in r.text
    sent += 1

    wanted = set(VLLM_NAMES) | set(OUR_NAMES) | {"ray_serve_deployment_request_counter_total"}
    deadline = time.monotonic() + 120  # Ray's agents export about every 10 s
    while True:
        now = scrape(stack.metrics_port)
        missing = wanted - set(now)
        grown = total(now, "ray_vllm_request_success_total") - total(before, "ray_vllm_request_success_total")
        if not missing and grown >= sent:
            return now, sent, served_by
        if time.monotonic() > deadline:
            raise AssertionError(f"after 120 s the scrape lacks {sorted(missing)}; requests counted: {grown} of {sent}")
        time.sleep(2)


def test_every_name_with_sensible_values(traffic_scrape, stack):
    from gateway.stack import APP_NAME

    everything, sent, served_by = traffic_scrape
    # the main app's series only: other tests deploy more apps on the same Ray cluster
    s: Series = {name: [(lb, v) for lb, v in rows if lb.get("application") == APP_NAME] for name, rows in everything.items()}
    for name in VLLM_NAMES:
        for labels, _ in s[name]:
            assert labels.get("model_name") == MODEL and labels.get("engine") == "0", (name, labels)
            assert labels.get("WorkerId") and labels.get("deployment") and labels.get("replica"), (name, labels)
    # per replica: one running and one waiting gauge each, for every replica that served traffic
    for gauge in ("ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting", "ray_vllm_kv_cache_usage_perc"):
        replicas = {labels["replica"] for labels, _ in s[gauge]}
        assert served_by <= replicas, (gauge, served_by, replicas)
        assert all(v >= 0 for _, v in s[gauge]), s[gauge]
    assert all(0 <= v <= 1 for _, v in s["ray_vllm_kv_cache_usage_perc"])
    # hits <= queries on every replica, and the repeated system prompt did hit
    for worker in {labels["WorkerId"] for labels, _ in s["ray_vllm_prefix_cache_queries_total"]}:
        hits = total(s, "ray_vllm_prefix_cache_hits_total", WorkerId=worker)
        assert hits <= total(s, "ray_vllm_prefix_cache_queries_total", WorkerId=worker)
    assert total(s, "ray_vllm_prefix_cache_hits_total") > 0
    reasons = {labels["finished_reason"] for labels, _ in s["ray_vllm_request_success_total"]}
    assert reasons <= {"stop", "length", "abort"} and reasons & {"stop", "length"}, reasons
    # histograms: cumulative buckets, +Inf bucket == count
    for base in ("ray_vllm_time_to_first_token_seconds", "ray_vllm_request_prompt_tokens", "ray_prefixgate_route_decision_seconds"):
        by_series: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
        for labels, v in s[f"{base}_bucket"]:
            key = tuple(sorted((k, x) for k, x in labels.items() if k != "le"))
            by_series[key].append((float(labels["le"]), v))
        for key, buckets in by_series.items():
            counts = [v for _, v in sorted(buckets)]
            assert counts == sorted(counts), (base, key, counts)
            assert counts[-1] == total(s, f"{base}_count", **dict(key)), (base, key)
    assert total(s, "ray_vllm_time_to_first_token_seconds_count") >= sent
    # ours: routing decisions by policy and reason, from the router inside the gateway replica
    decisions = s["ray_prefixgate_route_decisions_total"]
    assert stack.config.policy in {labels["policy"] for labels, _ in decisions}, decisions
    from router.policy import REASONS

    assert {labels["reason"] for labels, _ in decisions} <= set(REASONS)  # the one list, `pull` and `stale` included
    assert sum(v for _, v in decisions) >= sent
    assert total(s, "ray_prefixgate_requests_total", endpoint="chat", status="200") >= sent
    # every replica metric joins Serve's request counter on WorkerId (Ray's dashboard relies on it)
    serve_workers = {labels.get("WorkerId") for labels, _ in everything["ray_serve_deployment_request_counter_total"]}
    vllm_workers = {labels["WorkerId"] for labels, _ in s["ray_vllm_num_requests_running"]}
    assert vllm_workers <= serve_workers, (vllm_workers, serve_workers)


@pytest.mark.parametrize("dashboard", ["prefixgate", "ray_serve_llm"])
def test_dashboard_queries_name_only_exported_metrics(traffic_scrape, dashboard):
    s = traffic_scrape[0]
    queries = our_dashboard_queries() if dashboard == "prefixgate" else ray_serve_llm_queries()
    problems = []
    for expr in queries:
        q = parse(expr)
        problems += [f"{name} (in {expr[:120]!r})" for name in sorted(q.metrics) if name not in s]
        for metric, label in sorted(q.required_labels):
            if label not in NOT_OURS_LABELS and metric in s and not any(label in lb for lb, _ in s[metric]):
                problems.append(f"{metric} has no label {label}")
        present = set().union(*(lb.keys() for m in q.metrics for lb, _ in s.get(m, [])))
        problems += [f"no metric of {sorted(q.metrics)} has label {label}"
                     for label in sorted(q.grouping_labels - present - NOT_OURS_LABELS)]
    assert not problems, "\n".join(problems)


def test_every_panel_is_filled_in_prometheus(traffic_scrape, live_prometheus, stack):
    """Both dashboards' queries, evaluated by a real Prometheus over the scraped stack, each return
    data (Grafana variables at "All", rate window 5m)."""
    prom = live_prometheus
    # Ray's "peak tokens/s" panel evaluates rate() at whole minutes: give it one with data behind it
    while time.monotonic() - prom.started_at < 65:
        time.sleep(1)
    queries = our_dashboard_queries() + ray_serve_llm_queries()
    empty = [q for q in queries if prom.series(q) == 0]
    deadline = time.monotonic() + 240  # a hang guard: Ray's agents export about every 10 s
    while empty and time.monotonic() < deadline:
        # a gauge whose replica's export lapsed on a loaded machine: fresh traffic, fresh samples
        assert _chat(stack.url, [{"role": "user", "content": "One more city?"}], "metrics-refresh").status_code == 200
        time.sleep(5)
        empty = [q for q in empty if prom.series(q) == 0]
    scrapes = [(r["metric"].get("__name__"), r["value"][1]) for q in ("up", "scrape_duration_seconds") for r in prom.query(q)]
    assert not empty, f"queries without data (scrapes: {scrapes}):\n" + "\n".join(" ".join(q.split())[:200] for q in empty)


TIER_SERIES = ("ray_prefixgate_kv_tier_blocks", "ray_prefixgate_kv_tier_capacity_blocks",
               "ray_prefixgate_kv_tier_hit_tokens_total", "ray_prefixgate_kv_tier_promotions_total",
               "ray_prefixgate_kv_tier_demotions_total", "ray_prefixgate_kv_tier_dropped_total",
               "ray_prefixgate_kv_tier_bytes_total")


def test_a_stack_without_tiers_exports_the_tier_row_at_zero(stack):
    """The dashboard's tier row reads 0 on a stack with no tier configured, not "no data": its
    replicas export every tier series for both media from start-up."""
    from gateway.config import AppConfig
    from router.protocol.media import LOWER_MEDIA
    from tests.helpers.stack import side_app, wait_until

    name = "notiers"
    config = AppConfig(redis_url=stack.config.redis_url, key_prefix=f"notiers-{uuid.uuid4().hex[:6]}", engine="sim",
                       replicas=1, num_blocks=64, block_size=16, max_model_len=1024, kv_host_mb=0, kv_disk_mb=0)

    def tier_rows() -> dict[str, list[tuple[dict[str, str], float]]] | None:
        scraped = scrape(stack.metrics_port)
        rows = {m: [(lb, v) for lb, v in scraped.get(m, []) if lb.get("application") == name] for m in TIER_SERIES}
        return rows if all({lb.get("medium") for lb, _ in rows[m]} >= set(LOWER_MEDIA) for m in TIER_SERIES) else None

    with side_app(stack, name, config):
        # Ray's agents export about every 10 s: until the app's replica has exported every tier series
        rows = wait_until("the app without tiers exporting every tier series for both media", tier_rows, timeout_s=120)
    assert {lb["direction"] for lb, _ in rows["ray_prefixgate_kv_tier_bytes_total"]} == {"in", "out"}
    assert all(v == 0 for r in rows.values() for _, v in r), rows  # no tier: no capacity, no traffic
