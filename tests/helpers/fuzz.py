"""Fuzzing the HTTP API (tests/test_fuzz_api.py on our replicas, tests/test_vllm_backend.py on
vLLM's): hypothesis strategies for JSON-ish bodies of every field, what every answer must look
like, and one request checked end to end."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, note, settings
from hypothesis import strategies as st

from tests.helpers.stack import MODEL

REQUEST_TIMEOUT_S = 60.0  # one request, whole answer: a hang shows as a failure, not a stuck run
SMALL_MAX_TOKENS = 4  # keeps every valid request quick on CPU
VOCAB = 49152  # SmolLM2's vocabulary: valid token ids are [0, VOCAB)
FUZZ = settings(
    max_examples=16,  # per test, real requests on 2 CPU cores; the suite's CI budget is 30 minutes
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # shrinking would replay hundreds of real requests
    suppress_health_check=list(HealthCheck),
)


# ---- talking to the stack ---------------------------------------------------------------------
def post(url: str, path: str, content: bytes | Iterator[bytes], headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, str], bytes]:
    """POST and read the whole answer (streamed or not) under one overall deadline."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    hdrs = {"content-type": "application/json", **(headers or {})}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        with client.stream("POST", f"{url}{path}", content=content, headers=hdrs) as r:
            body = b""
            for piece in r.iter_bytes():
                body += piece
                assert time.monotonic() < deadline, f"{path} still answering after {REQUEST_TIMEOUT_S}s"
            return r.status_code, dict(r.headers), body


def route_decisions(url: str) -> float:
    """Sum of prefixgate_route_decisions_total: grows by one per request sent to a replica."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("prefixgate_route_decisions_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---- what every answer must look like ----------------------------------------------------------
def check_error_body(status: int, body: bytes) -> dict:
    """Every refusal is {"error": {"message": str, "type": str, ...}}."""
    try:
        data = json.loads(body)
    except ValueError:
        raise AssertionError(f"{status} with a non-JSON body: {body[:300]!r}") from None
    assert isinstance(data, dict) and isinstance(data.get("error"), dict), (status, data)
    error = data["error"]
    assert isinstance(error.get("message"), str) and error["message"], (status, error)
    assert isinstance(error.get("type"), str) and error["type"], (status, error)
    return error


def _check_usage(usage: dict) -> None:
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert isinstance(usage[key], int) and usage[key] >= 0, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"], usage


def check_completion(body: bytes, chat: bool) -> None:
    data = json.loads(body)
    assert data["object"] == ("chat.completion" if chat else "text_completion"), data
    assert data["model"] == MODEL and isinstance(data["id"], str) and data["id"]
    assert [c["index"] for c in data["choices"]] == list(range(len(data["choices"]))) and data["choices"]
    for c in data["choices"]:
        text = c["message"]["content"] if chat else c["text"]
        assert isinstance(text, str), c
        assert c["finish_reason"] in ("stop", "length"), c
    _check_usage(data["usage"])


def check_sse(body: bytes, chat: bool) -> None:
    lines = [line for line in body.decode("utf-8").split("\n") if line]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    finished: set[int] = set()
    for line in lines[:-1]:
        assert line.startswith("data: "), line
        chunk = json.loads(line.removeprefix("data: "))
        assert "error" not in chunk, f"stream ended with an error chunk: {chunk}"
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion"), chunk
        for c in chunk["choices"]:
            if c.get("finish_reason") is not None:
                assert c["finish_reason"] in ("stop", "length"), c
                finished.add(c["index"])
        if chunk.get("usage"):
            _check_usage(chunk["usage"])
    assert finished, "no choice finished"


def check_answer(path: str, status: int, headers: dict[str, str], body: bytes, stats: Counter) -> None:
    """The contract: never 5xx; 4xx OpenAI-shaped; 200 a well-formed completion or SSE stream."""
    stats[status] += 1
    assert status < 500, f"server error {status}: {body[:500]!r}"
    chat = path.endswith("chat/completions")
    if status != 200:
        assert 400 <= status < 500, status
        check_error_body(status, body)
        return
    if headers.get("content-type", "").startswith("text/event-stream"):
        stats["sse"] += 1
        check_sse(body, chat)
    else:
        check_completion(body, chat)


# ---- (a) hypothesis: JSON-ish bodies ------------------------------------------------------------
# Lone surrogates are left to (c), where each field is tried on its own: here they would hide
# every other finding behind the first one.
_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=30)
_ints = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30]),
)
_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, 2.0000001, 1e-320, 1e308, -1e308]),
)
_scalars = st.one_of(st.none(), st.booleans(), _ints, _floats, _text)
JUNK = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=10,
)


# Each field: (plausible values, field-specific junk). A body takes plausible values for most of
# its fields and junk for a few, so that fuzzing reaches the model as well as the validator.
_role = st.sampled_from(["system", "developer", "user", "assistant"])
_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text}), max_size=3)
_content = st.one_of(_text, st.none(), _parts)
_message = st.fixed_dictionaries({"role": _role, "content": _content}, optional={"name": _text})
_bad_message = st.one_of(
    st.fixed_dictionaries({"role": JUNK, "content": _content}),
    st.fixed_dictionaries({"role": _role, "content": JUNK}),
    st.fixed_dictionaries({"role": _role, "content": st.lists(st.dictionaries(_text, JUNK, max_size=3), min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": _role, "content": _content, "name": JUNK}),
    JUNK,
)
_token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
_bad_token_ids = st.lists(st.one_of(st.integers(-3, VOCAB + 3), _ints, _floats, st.booleans()), max_size=40)

COMMON: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "max_tokens": (st.integers(1, SMALL_MAX_TOKENS), _ints),
    "temperature": (st.floats(0.0, 2.0), _floats),
    "top_p": (st.floats(0.0, 1.0, exclude_min=True), _floats),
    "top_k": (st.integers(-1, 100), _ints),
    "seed": (st.integers(0, 2**63 - 1), _ints),
    "stop": (st.one_of(_text, st.lists(_text, max_size=4)), st.lists(_text, min_size=5, max_size=9)),
    "n": (st.integers(1, 3), _ints),
    "stream": (st.booleans(), _scalars),
    "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
                       st.dictionaries(st.sampled_from(["include_usage", "x"]), JUNK, max_size=2)),
    "user": (_text, st.text(min_size=257, max_size=300)),
    "presence_penalty": (st.one_of(st.none(), st.floats(-2.0, 2.0)), _floats),
    "frequency_penalty": (st.one_of(st.none(), st.floats(-2.0, 2.0)), _floats),
    "repetition_penalty": (st.one_of(st.none(), st.floats(0.5, 2.0)), _floats),
    "prompt_cache_key": (_text, st.text(min_size=257, max_size=300)),
    "logit_bias": (st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100.0, 100.0), max_size=4),
                   st.one_of(JUNK, st.dictionaries(st.one_of(_text, st.integers(VOCAB, 2**70).map(str)), JUNK,
                                                   min_size=1, max_size=3))),
    "response_format": (
        st.sampled_from([None, {"type": "text"}, {"type": "json_object"},
                         {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                             "type": "object", "properties": {"a": {"type": "integer"}}}}}]),
        st.one_of(JUNK, st.fixed_dictionaries({"type": st.just("json_schema"),
                                               "json_schema": st.fixed_dictionaries({"schema": JUNK})})),
    ),
}
CHAT_FIELDS = {
    **COMMON,
    "messages": (st.lists(_message, min_size=1, max_size=4),
                 st.lists(st.one_of(_message, _bad_message), max_size=4)),
    "max_completion_tokens": (st.integers(1, SMALL_MAX_TOKENS), _ints),
    "tools": (st.sampled_from([None, []]), st.lists(JUNK, min_size=1, max_size=2)),
    "logprobs": (st.sampled_from([None, False, True]), _scalars),
    "top_logprobs": (st.one_of(st.none(), st.integers(0, 20)), _ints),
}
COMPLETION_FIELDS = {
    **COMMON,
    "prompt": (st.one_of(_text, _token_ids, st.lists(_text, min_size=1, max_size=1), st.lists(_token_ids, min_size=1, max_size=1)),
               st.one_of(_bad_token_ids, st.lists(_text, max_size=3), st.lists(_bad_token_ids, max_size=2))),
    "echo": (st.sampled_from([None, False]), _scalars),
    "suffix": (st.sampled_from([None, ""]), _text),
    "best_of": (st.sampled_from([None, 1]), _ints),
    "logprobs": (st.one_of(st.none(), st.integers(0, 20)), _scalars),
}
REQUIRED = {"model", "messages", "prompt"}


def bound_lengths(body: Any) -> Any:
    """A valid max_tokens that would still fit the context is made small, so requests stay quick.

    Values far beyond the context (the model's 2048) are kept: they are refused at once.
    """
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and SMALL_MAX_TOKENS < v < 4096:
                body[key] = v % SMALL_MAX_TOKENS + 1
    return body


@st.composite
def bodies(draw: st.DrawFn, fields: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]]) -> bytes:
    names = sorted(fields)
    present = draw(st.sets(st.sampled_from(names)))
    present |= {n for n in fields if n in REQUIRED and draw(st.integers(0, 9))}  # required: mostly there
    junk = draw(st.sets(st.sampled_from(sorted(present)), max_size=2)) if present and draw(st.booleans()) else set()
    body: Any = {"model": draw(st.one_of(st.just(MODEL), JUNK)) if draw(st.integers(0, 5)) == 0 else MODEL}
    for name in sorted(present):
        valid, bad = fields[name]
        body[name] = draw(st.one_of(bad, JUNK) if name in junk else valid)
    if "stream" not in present:
        body["stream"] = draw(st.booleans())  # half the requests stream
    body.update(draw(st.dictionaries(_text.filter(lambda k: k not in fields and k != "model"), JUNK, max_size=2)))
    if draw(st.integers(0, 19)) == 0:  # sometimes not an object at all
        body = draw(JUNK)
    bound_lengths(body)
    text = json.dumps(body, ensure_ascii=draw(st.booleans()), allow_nan=True)
    if draw(st.booleans()):  # infinities as huge literals, as other JSON encoders write them
        text = re.sub(r"(?<![\w.])(-?)Infinity\b", r"\g<1>1e999", text)
    return text.encode("utf-8")


def _fuzz(url: str, path: str, raw: bytes, stats: Counter) -> None:
    note(raw[:2000].decode("utf-8", "replace"))
    status, headers, body = post(url, path, raw)
    note(f"-> {status} {body[:500]!r}")
    check_answer(path, status, headers, body, stats)
