"""The OpenAI fields real clients send: logprobs, penalties, response_format, prompt_cache_key, and
OpenAI-shaped errors for unknown paths and methods. The real model where correctness matters:
the engine directly against transformers, and the whole stack over HTTP."""

from __future__ import annotations

import json
import uuid

import httpx
import jsonschema
import pytest
import torch

from router.protocol.sampling import SamplingParams

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "List the numbers from one to twenty, separated by commas."


@pytest.fixture(scope="module")
def engine(default_model_dir):
    from replica.engine import LLMEngine

    return LLMEngine(default_model_dir, block_size=16, num_blocks=256, dtype="float32")


def _chat_prompt(engine, text: str) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": text}])


def _hf_logits(hf_reference, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_reference(torch.tensor([tokens])).logits[0].float()


# ---- engine against transformers ------------------------------------------------------------
def test_logprobs_match_transformers_log_softmax(engine, hf_reference):
    prompt = _chat_prompt(engine, "What is the capital of France?")
    [out] = engine.generate([prompt], SamplingParams(max_tokens=12, logprobs=5))
    assert [e["token_id"] for e in out.logprobs] == out.token_ids
    reference = torch.log_softmax(_hf_logits(hf_reference, prompt + out.token_ids), dim=-1)
    worst = 0.0
    for i, entry in enumerate(out.logprobs):
        row = reference[len(prompt) - 1 + i]
        assert entry["token_id"] == int(row.argmax())  # greedy: the chosen token is the top one
        worst = max(worst, abs(entry["logprob"] - float(row[entry["token_id"]])))
        top_values, top_ids = row.topk(5)
        assert [t["logprob"] for t in entry["top"]] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert [t["token_id"] for t in entry["top"]] == top_ids.tolist()
    assert worst < 1e-4, worst
    text = "".join(e["token"] for e in out.logprobs)
    assert text.startswith(out.text)  # token strings spell the answer (the EOS token's text follows)


@pytest.mark.parametrize("penalties", [
    {"frequency_penalty": 1.0, "presence_penalty": 0.5},
    {"repetition_penalty": 1.3},
])
def test_penalties_change_greedy_output_exactly_as_specified(engine, hf_reference, penalties):
    """Every token of a penalised greedy run is the argmax of the plain model's logits after
    the penalty formula (OpenAI: generated tokens; vLLM repetition: prompt and generated)."""
    prompt = _chat_prompt(engine, QUESTION)
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=24))
    [pen] = engine.generate([prompt], SamplingParams(max_tokens=24, **penalties))
    assert pen.token_ids != plain.token_ids
    logits = _hf_logits(hf_reference, prompt + pen.token_ids)
    vocab = logits.shape[-1]
    for i, token in enumerate(pen.token_ids):
        row = logits[len(prompt) - 1 + i].clone()
        before = torch.bincount(torch.tensor(pen.token_ids[:i], dtype=torch.long), minlength=vocab).float()
        if "repetition_penalty" in penalties:
            r = penalties["repetition_penalty"]
            seen = before > 0
            seen[torch.tensor(prompt)] = True
            row = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
        else:
            row = row - penalties["frequency_penalty"] * before - penalties["presence_penalty"] * (before > 0).float()
        top2 = row.topk(2).values
        if float(top2[0] - top2[1]) > 1e-3:  # skip near-ties that float rounding may flip
            assert token == int(row.argmax()), (i, token, int(row.argmax()))


def test_response_format_on_the_engine(engine):
    fmt = {"type": "json_schema", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"]}}
    prompt = _chat_prompt(engine, "What is the capital of France? Answer in JSON with city and country.")
    [out] = engine.generate([prompt], SamplingParams(max_tokens=60, response_format=fmt))
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), fmt["schema"])
    # a constrained answer cut by max_tokens ends as "length" (and is not valid JSON yet)
    [cut] = engine.generate([prompt], SamplingParams(max_tokens=4, response_format=fmt))
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4


def test_unsupported_schema_is_refused_before_scheduling(engine):
    from replica.engine import InvalidRequestError

    bad = {"type": "json_schema", "schema": {"type": "string", "pattern": "(?<=a)b"}}
    with pytest.raises(InvalidRequestError, match="not supported"):
        engine.add_request([1, 2, 3], SamplingParams(response_format=bad))
    assert not engine.has_unfinished


# ---- through the gateway --------------------------------------------------------------------
def _post(stack, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json={"model": MODEL, **body}, headers=headers or {}, timeout=120)


def _sse(stack, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{stack.url}{path}", json={"model": MODEL, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]


JSON_PROMPTS = [
    "Give me a JSON object describing a cat with a name and an age.",
    "Describe the planet Mars as a JSON object.",
    "Return a JSON object with the keys fruit and colour for a banana.",
]
SCHEMA = {
    "type": "object",
    # bounded values: a 135M model left free loops on digits (then max_tokens ends it: "length")
    "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30},
                   "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
                   "capital": {"type": "boolean"}},
    "required": ["city", "country", "population_millions", "capital"],
}


def test_json_object_and_json_schema_through_the_gateway(stack):
    stopped = 0
    for question in JSON_PROMPTS:
        r = _post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": question}],
                                                   "max_tokens": 64, "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            stopped += 1
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:
            assert choice["finish_reason"] == "length"
    assert stopped >= 2
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    body = {"messages": [{"role": "user", "content": "Tell me about Paris in JSON."}], "max_tokens": 80,
            "response_format": fmt}
    r = _post(stack, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    # streamed, the same constraint holds
    chunks = _sse(stack, "/v1/chat/completions", body)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)
    # a schema the grammar library cannot compile is a 400, in OpenAI's shape
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}
    r = _post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": bad})
    assert r.status_code == 400 and "not supported" in r.json()["error"]["message"], r.text


def test_logprobs_in_openai_shapes_streaming_and_not(stack):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = _post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "logprobs": True, "top_logprobs": 3})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"]
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 3
        assert e["logprob"] <= 0 and bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][-1]["logprob"]
    assert choice["message"]["content"].startswith("".join(e["token"] for e in content)[:10])
    streamed = [e for c in _sse(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "logprobs": True,
                                                                 "top_logprobs": 3})
                for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-5)
    plain = _post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 4}).json()
    assert plain["choices"][0]["logprobs"] is None

    r = _post(stack, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6, "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    assert all(tok in top and 2 <= len(top) <= 3 for tok, top in zip(lp["tokens"], lp["top_logprobs"], strict=True))
    chunks = _sse(stack, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6, "logprobs": 2})
    tokens = [t for c in chunks for ch in c["choices"] if ch.get("logprobs") for t in ch["logprobs"]["tokens"]]
    offsets = [t for c in chunks for ch in c["choices"] if ch.get("logprobs") for t in ch["logprobs"]["text_offset"]]
    assert tokens == lp["tokens"] and offsets == lp["text_offset"]


def test_penalties_are_served(stack):
    messages = [{"role": "user", "content": QUESTION}]
    plain = _post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 24})
    penalised = _post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 24,
                                                      "frequency_penalty": 1.0, "presence_penalty": 0.5})
    assert plain.status_code == penalised.status_code == 200, penalised.text
    assert plain.json()["choices"][0]["message"]["content"] != penalised.json()["choices"][0]["message"]["content"]
    r = _post(stack, "/v1/chat/completions", {"messages": messages, "presence_penalty": 2.5})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("presence_penalty")


def test_logit_bias_steers_greedy_decoding(stack, engine):
    """logit_bias as OpenAI defines it: +100 on a token makes a greedy run produce only it; -100
    on the token a greedy run starts with makes it start otherwise; bad keys and values are 400s."""
    word = engine.tokenizer.encode(" harbour")[0]
    messages = [{"role": "user", "content": QUESTION}]
    forced = _post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0,
                                                   "logit_bias": {str(word): 100}})
    assert forced.status_code == 200, forced.text
    assert forced.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode([word] * 4)
    ids = engine.tokenizer.encode(QUESTION)
    top = _post(stack, "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0})
    banned_text = top.json()["choices"][0]["text"]
    banned = engine.tokenizer.encode(banned_text)
    assert len(banned) == 1, f"the greedy first token {banned_text!r} does not re-encode to one id: {banned}"
    banned = banned[0]
    other = _post(stack, "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0,
                                             "logit_bias": {str(banned): -100}})
    assert other.status_code == 200, other.text
    assert other.json()["choices"][0]["text"] != banned_text
    for bias, what in (({"harbour": 1}, "token ids"), ({str(word): 100.5}, "[-100, 100]"),
                       ({"99999999": 1}, "[0, ")):
        r = _post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "logit_bias": bias})
        assert r.status_code == 400 and what in r.json()["error"]["message"], r.text


def test_prompt_cache_key_routes_like_a_session(stack):
    key = f"pck-{uuid.uuid4().hex[:6]}"
    # a prompt long enough that its cached blocks outweigh a queue-length reading that lags by a
    # request (as in test_gateway_e2e's three-turn session)
    system = "You are a patient geography tutor. Answer in one short sentence and name the country. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of Spain?"}]
    replicas, routes = [], []
    for follow_up in ["And of Portugal?", "And of Greece?", None]:
        r = _post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "prompt_cache_key": key})
        assert r.status_code == 200, r.text
        replicas.append(r.headers["x-prefixgate-replica"])
        routes.append(r.headers["x-prefixgate-route"])
        if follow_up:
            messages = messages + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                                   {"role": "user", "content": follow_up}]
    assert len(set(replicas)) == 1, (replicas, routes)
    # the later turns go by the key as a session: through the index ("session"), or, when the
    # index lookup misses its deadline on a busy machine, through the router's own memory of the
    # session's replica ("stale", router/decider.py `degraded`); never by prefix or load
    assert all(route in ("session", "stale") for route in routes[1:]), routes


def test_session_key_precedence():
    from gateway.openai_models import ChatCompletionRequest, routing_session

    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    both = ChatCompletionRequest.model_validate({**base, "prompt_cache_key": "k", "user": "u"})
    assert routing_session("h", both) == "h"
    assert routing_session(None, both) == "k"
    assert routing_session(None, ChatCompletionRequest.model_validate({**base, "user": "u"})) == "u"
    assert routing_session(None, ChatCompletionRequest.model_validate(base)) is None


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nothing-here", 404),
    ("POST", "/v2/chat/completions", 404),
    ("GET", "/v1/chat/completions", 405),
    ("DELETE", "/v1/models", 405),
])
def test_unknown_paths_and_methods_answer_openai_errors(stack, method, path, status):
    r = httpx.request(method, f"{stack.url}{path}", timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert path in error["message"]
