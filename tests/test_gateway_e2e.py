"""End to end over real HTTP: Ray Serve, 2 replicas of the real model, real Redis, the router."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.helpers.stack import MODEL, _replica_loads, chat, three_turn_session, wait_idle


def test_three_turn_session_grows_cache_and_stays_home(stack):
    three_turn_session(stack)


def test_streaming_and_non_streaming_agree(stack):
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    plain = chat(stack, messages).json()["choices"][0]["message"]["content"]
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True}}
    pieces, usage, finish = [], None, None
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-prefixgate-replica"]
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        assert chunk["object"] == "chat.completion.chunk"
        for choice in chunk["choices"]:
            pieces.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
        usage = chunk.get("usage") or usage
    assert "".join(pieces) == plain
    assert finish in ("stop", "length") and usage["completion_tokens"] > 0
    # no chunk with choices before the first token (a client's time to first chunk is its TTFT):
    # the first one already carries text, and the assistant role rides on it
    first = next(json.loads(x.removeprefix("data: ")) for x in lines[:-1] if json.loads(x.removeprefix("data: "))["choices"])
    assert first["choices"][0]["delta"]["content"] and first["choices"][0]["delta"]["role"] == "assistant", first
    roles = [c["delta"].get("role") for x in lines[:-1] for c in json.loads(x.removeprefix("data: "))["choices"]]
    assert roles.count("assistant") == 1


def test_completions_with_text_and_token_ids(stack):
    r = httpx.post(f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5}, timeout=60)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    ids = stack_tokenize(stack, "The capital of France is")
    r2 = httpx.post(f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 5}, timeout=60)
    assert r2.status_code == 200 and r2.json()["choices"][0]["text"] == text
    assert r2.json()["object"] == "text_completion"


def stack_tokenize(stack, text):
    from transformers import AutoTokenizer

    from replica.default_model import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir()).encode(text)


def test_official_openai_client(stack):
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == [MODEL]
    card = client.models.retrieve(MODEL)  # GET /v1/models/{id}: the same card
    assert card.id == MODEL and card.object == "model"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
    assert "Paris" in resp.choices[0].message.content
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == resp.choices[0].message.content
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt just ran
    from openai import BadRequestError, NotFoundError

    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=messages)
    with pytest.raises(NotFoundError, match="`gpt-4` does not exist"):
        client.models.retrieve("gpt-4")
    with pytest.raises(BadRequestError):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=-1)


BAD_REQUESTS = [
    ("malformed json", b'{"model": "x", "messages": [', 400),
    ("not an object", b"[1, 2, 3]", 400),
    ("invalid utf-8", b'{"model": "\xff\xfe", "messages": []}', 400),
    ("deep nesting", b'{"model": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400),
    ("wrong type", {"model": MODEL, "messages": "hello"}, 400),
    ("wrong type of max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400),
    ("unknown model", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("empty messages", {"model": MODEL, "messages": []}, 400),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("negative max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400),
    ("huge max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**12}, 400),
    ("prompt beyond context", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}]}, 400),
    ("n zero", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 0}, 400),
    ("temperature out of range", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 7}, 400),
    ("penalty out of range", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, 400),
    ("top_logprobs without logprobs", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400),
    ("empty completion prompt", {"model": MODEL, "prompt": ""}, 400),
    ("token id out of vocabulary", {"model": MODEL, "prompt": [1, 2, 10**9]}, 400),
    ("functions (deprecated tools)", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "functions": [{"name": "f", "parameters": {}}]}, 400),
]


@pytest.mark.parametrize("name, payload, status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_openai_error(stack, name, payload, status):
    path = "/v1/completions" if isinstance(payload, dict) and "prompt" in payload else "/v1/chat/completions"
    kwargs = {"json": payload} if isinstance(payload, dict) else {"content": payload, "headers": {"content-type": "application/json"}}
    r = httpx.post(f"{stack.url}{path}", timeout=30, **kwargs)
    assert r.status_code == status, (name, r.status_code, r.text[:200])
    error = r.json()["error"]
    assert error["message"] and error["type"]


@pytest.mark.parametrize("header", ["x-session-id", "x-request-id", "serve_multiplexed_model_id", "traceparent"])
def test_a_header_that_is_not_utf8_gets_a_400_naming_it(stack, header):
    """Serve's proxy decodes these headers as UTF-8 before the gateway sees the request: without
    gateway/http_guard.py such bytes were a bare-text 500 from the proxy."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for method, path, kwargs in (("POST", "/v1/chat/completions", {"json": body}), ("GET", "/health", {})):
        r = httpx.request(method, f"{stack.url}{path}", headers=[(header.encode(), b"a\xffb")], timeout=30, **kwargs)
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
        assert r.json()["error"] == {"message": f"header {header!r} is not valid UTF-8",
                                     "type": "invalid_request_error", "param": header, "code": None}
    # UTF-8 beyond ASCII is fine, in these headers as in any other
    r = httpx.post(f"{stack.url}/v1/chat/completions", headers=[(header.encode(), "café-1".encode())], json=body,
                   timeout=60)
    assert r.status_code == 200, r.text


def test_a_session_key_longer_than_256_characters_is_refused(stack):
    """Routers and Redis keep an entry per session key: the header is bounded as the body's
    prompt_cache_key and user are (a 60 KB x-session-id was accepted and stored)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers={"x-session-id": "s" * 257}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "x-session-id" and "256" in r.json()["error"]["message"]
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers={"x-session-id": "s" * 256}, timeout=60)
    assert r.status_code == 200, r.text


def test_sampling_rules_are_checked_at_the_gateway_with_the_field_named(stack):
    """A value the request schema lets through but the engines' SamplingParams refuses (here
    min_tokens above max_tokens) is a 400 naming the field, answered before any replica runs it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "min_tokens": 9}
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "min_tokens" and "min_tokens" in error["message"] and error["type"] == "invalid_request_error"


def test_oversized_body_is_refused(stack):
    r = httpx.post(f"{stack.url}/v1/chat/completions", content=b"x" * (5 * 2**20), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_n_choices(stack):
    r = chat(stack, [{"role": "user", "content": "Say a word."}], n=2, seed=3, max_tokens=8)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


def _generated(stack) -> int:
    return sum(int(ld.get("generated_tokens", 0)) for ld in _replica_loads(stack))


def test_client_disconnect_aborts_and_frees_blocks(stack):
    """The client leaves after 4 chunks of a greedy story that runs to max_tokens when left
    alone: generation stops early (fewer tokens generated than the undisturbed run) and every
    block is released."""
    messages = [{"role": "user", "content": "Write a very long story about a dragon."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 160, "temperature": 0}
    wait_idle(stack)
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    full = r.json()
    assert full["choices"][0]["finish_reason"] == "length"  # left alone, it runs all 160 tokens
    wait_idle(stack)
    before = _generated(stack)
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen >= 4:
                break  # the client goes away mid-stream
    # idle in a heartbeat that already counts this request's tokens (one snapshot: final counts)
    deadline = time.monotonic() + 60
    while not (_generated(stack) > before and wait_idle(stack)):
        assert time.monotonic() < deadline, "no heartbeat counted the request"
        time.sleep(0.25)
    generated = _generated(stack) - before
    # stopped before it ran to its end (how many tokens the abort's hops take varies with the load)
    assert 0 < generated < full["usage"]["completion_tokens"], generated


def test_health_models_and_metrics(stack):
    assert httpx.get(f"{stack.url}/health", timeout=30).json()["status"] == "ok"
    assert httpx.get(f"{stack.url}/v1/models").json()["data"][0]["id"] == MODEL
    chat(stack, [{"role": "user", "content": "Hello!"}], session="metrics-check")
    text = httpx.get(f"{stack.url}/metrics").text
    for name in ("prefixgate_prefix_cache_queries_tokens_total{replica=", "prefixgate_prefix_cache_hits_tokens_total{replica=",
                 "prefixgate_time_to_first_token_seconds_bucket", f"prefixgate_routed_requests_total{{model_name=\"{MODEL}\",reason=",
                 "prefixgate_route_decisions_total{policy=\"affinity-pull\"", "prefixgate_route_decision_seconds_bucket"):
        assert name in text, name
