"""Metrics as the tests read them: a scrape of a Prometheus endpoint as series, sums over label
matches, and every query of our Grafana dashboard and of Ray's Serve LLM dashboard."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
# Ray's panels that need hardware or connectors we do not have
RAY_EXCLUDED = ("nixl", "kv_offload", "external_prefix_cache")


def _exprs(panels: list[dict]) -> list[str]:
    out = []
    for p in panels:
        out += [t["expr"] for t in p.get("targets", []) if t.get("expr")]
        out += _exprs(p.get("panels", []))
    return out


def _variable_queries(dashboard: dict) -> list[str]:
    out = []
    for v in dashboard.get("templating", {}).get("list", []):
        query = v.get("query")
        if isinstance(query, dict) and query.get("query"):
            out.append(query["query"])
    return out


def our_dashboard_queries() -> list[str]:
    d = json.loads((ROOT / "infra/grafana/prefixgate.json").read_text())
    return _exprs(d["panels"]) + _variable_queries(d)


def ray_serve_llm_queries() -> list[str]:
    from ray.dashboard.modules.metrics.grafana_dashboard_factory import (
        generate_serve_llm_grafana_dashboard,
    )

    d = json.loads(generate_serve_llm_grafana_dashboard()[0])
    queries = _exprs(d["panels"]) + _variable_queries(d)
    return [q for q in queries if not any(x in q for x in RAY_EXCLUDED)]


Series = dict[str, list[tuple[dict[str, str], float]]]


def scrape(port: int) -> Series:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    series: Series = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            series[s.name].append((dict(s.labels), s.value))
    return series


def total(series: Series, name: str, **match: str) -> float:
    return sum(v for labels, v in series.get(name, []) if all(labels.get(k) == x for k, x in match.items()))
