"""`prefixgate serve --compile true` for real: a Serve app whose replica runs the compiled forward
(built in the replica's constructor, before Serve routes to it) answers the same greedy tokens
as the session stack's eager replicas, on a cold prompt and again on its prefix hit."""

from __future__ import annotations

import uuid

import httpx

from gateway.config import AppConfig
from tests.helpers.stack import side_app

APP = "compiled"
MODEL = "SmolLM2-135M-Instruct"


def _complete(base: str, prompt: list[int]) -> dict:
    r = httpx.post(f"{base}/v1/completions", timeout=300,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_compiled_replica_serves_the_eager_greedy_tokens(stack, redis_server):
    config = AppConfig(replicas=1, compile=True, redis_url=redis_server.url, key_prefix=f"compiled-{uuid.uuid4().hex[:6]}",
                       kv_cache_mb=64, max_model_len=2048, default_max_tokens=12)
    shared = [(i * 37) % 4000 + 20 for i in range(48)]  # 3 blocks of 16 the second prompt hits
    prompts = [shared + [101, 102, 103], shared + [201, 202]]
    eager = [_complete(stack.url, p)["choices"][0]["text"] for p in prompts]
    with side_app(stack, APP, config) as base:
        got = [_complete(base, p) for p in prompts]
    assert [g["choices"][0]["text"] for g in got] == eager
    assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
