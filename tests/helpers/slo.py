"""What the latency-objective tests share: a chat request to a live app and sums of its /metrics
samples (a bounded wait on a condition is tests/helpers/stack.py's wait_until)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from replica.default_model import DEFAULT_MODEL_NAME


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric `name` in a /metrics text: (labels, value)."""
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def metric_sum(text: str, name: str, **match: str) -> float:
    """The sum of `name`'s samples whose labels include `match`."""
    return sum(v for labels, v in samples(text, name) if all(labels.get(k) == x for k, x in match.items()))


def ask(url: str, key: str, headers: dict[str, str] | None = None, stream: bool = False, **body) -> httpx.Response:
    """One chat completion with API key `key` and extra headers (the objectives)."""
    payload = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "Name three rivers."}],
               "max_tokens": 8, "ignore_eos": True, "stream": stream, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=120,
                      headers={"authorization": f"Bearer {key}", **(headers or {})})
