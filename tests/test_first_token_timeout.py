"""A request no replica starts within `first_token_timeout_s` gets a 504 with an OpenAI-style body
and the gateway's headers, streamed or not, and the gateway answers on: a live stack whose one
sim replica is modelled to take minutes over a prompt's first step, set through a Serve config."""

from __future__ import annotations

import uuid

import httpx
import pytest

from gateway.config import AppConfig
from replica.default_model import DEFAULT_MODEL_NAME
from tests.helpers.stack import side_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slow_start(stack):
    config = AppConfig.from_dict({
        "redis_url": stack.config.redis_url, "key_prefix": f"ftt-{uuid.uuid4().hex[:6]}", "engine": "sim",
        "replicas": 1, "num_blocks": 256, "block_size": 16, "max_model_len": 2048,
        "sim_service": {"prefill_s_per_token": 30.0},  # a prompt's first step: minutes, not the 2 s timeout
        "first_token_timeout_s": 2.0, "drain_timeout_s": 2.0,  # and the stuck replica is let go at once
    })
    with side_app(stack, "slowstart", config) as url:
        yield url


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_not_started_in_time_is_a_504_with_the_gateways_headers(slow_start, stream):
    body = {"model": DEFAULT_MODEL_NAME, "prompt": f"{stream} hello there", "max_tokens": 4, "stream": stream}
    r = httpx.post(f"{slow_start}/v1/completions", json=body, timeout=120)
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "timeout") and "in time" in error["message"]
    assert r.headers["x-prefixgate-gateway"]  # the gateway that answered, on refusals too
    health = httpx.get(f"{slow_start}/health", timeout=60)
    assert health.status_code == 200, health.text
