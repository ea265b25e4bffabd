"""Stream batching through the real stack (sim replicas beside the session's stack): a replica
sends everything produced since its last send as one chunk, so a stream has fewer SSE events
than tokens, and what the client reads is exactly the unstreamed answer: the same text, the
same usage, stop strings cut at the same place."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from gateway.config import AppConfig
from replica.default_model import DEFAULT_MODEL_NAME

APP = "batching"


@pytest.fixture(scope="module")
def sim_app(stack, redis_server):
    from ray import serve

    config = AppConfig.from_dict({
        "redis_url": redis_server.url, "key_prefix": f"sb-{uuid.uuid4().hex[:6]}", "replicas": 1, "engine": "sim",
        "num_blocks": 256, "stream_interval_ms": 200,  # as a Serve config sets it
        "sim_service": {"decode_step_s": 0.01, "prefill_overhead_s": 0.0},
    })
    url = stack.deploy(config, name=APP, route_prefix=f"/{APP}")
    yield url
    serve.delete(APP)


def _stream(url: str, body: dict) -> tuple[list[str], dict, str | None]:
    pieces, usage, finish = [], {}, None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    pieces.append(choice["text"])
                finish = choice.get("finish_reason") or finish
    return pieces, usage, finish


def _whole(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_stream_carries_several_tokens_per_event_and_the_same_answer(sim_app):
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "batched tokens please", "max_tokens": 60, "ignore_eos": True,
            "temperature": 0}
    pieces, usage, finish = _stream(sim_app, body)
    whole = _whole(sim_app, body)
    assert "".join(pieces) == whole["choices"][0]["text"]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == 60
    assert finish == "length"
    # 60 decode steps of 10 ms sent at most once per 200 ms: far fewer events than tokens
    assert len(pieces) < 60 // 3, pieces


def test_a_stop_string_cuts_a_batched_stream_where_it_cuts_the_answer(sim_app):
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "stop somewhere in here", "max_tokens": 60, "ignore_eos": True,
            "temperature": 0}
    words = _whole(sim_app, body)["choices"][0]["text"].split()
    stop = words[30]
    stopped = {**body, "stop": [stop]}
    pieces, usage, finish = _stream(sim_app, stopped)
    whole = _whole(sim_app, stopped)
    assert finish == whole["choices"][0]["finish_reason"] == "stop"
    assert "".join(pieces) == whole["choices"][0]["text"] and stop not in "".join(pieces)
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] < 60


@pytest.mark.parametrize("field, extra", [("logprobs", {"logprobs": 2}),
                                          ("response_format", {"response_format": {"type": "json_object"}})])
def test_a_sim_replica_refuses_what_it_cannot_honour(sim_app, field, extra):
    """The sim engine has no logprobs and no grammar: a 400 naming the field, never an answer
    that silently ignores it."""
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "honour me", "max_tokens": 4, **extra}
    r = httpx.post(f"{sim_app}/v1/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
