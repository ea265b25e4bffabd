"""Fuzzing the HTTP API of the real stack (gateway + router + 2 replicas of the real model).

The gateway promises that bad input is a 4xx with an OpenAI-shaped body, never a 500 or a hang,
and that it is refused before any replica sees it. Hand-written cases (tests/test_gateway_e2e.py)
cover the obvious ones; here hypothesis and schemathesis look for the rest.

(a) hypothesis: JSON-ish bodies mixing valid values with junk for every field;
(b) schemathesis: bodies drawn from the gateway's own OpenAPI schema (positive and negative);
(c) hand-picked abuse: oversized prompts, invalid UTF-8, deep nesting, absurd sampling values,
    each checked to be refused without a routing decision (so no replica ever saw it).
"""

from __future__ import annotations

import copy
import json
import math
import re
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from tests.test_gateway_e2e import MODEL

pytestmark = pytest.mark.slow

REQUEST_TIMEOUT_S = 60.0  # one request, whole answer: a hang shows as a failure, not a stuck run
SMALL_MAX_TOKENS = 4  # keeps every valid request quick on CPU
VOCAB = 49152  # SmolLM2's vocabulary: valid token ids are [0, VOCAB)
FUZZ = settings(
    max_examples=60,
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


def _field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Half the time a plausible value, half the time anything at all."""
    return st.one_of(valid, JUNK)


_role = _field(st.sampled_from(["system", "developer", "user", "assistant"]))
_content = _field(
    st.one_of(
        _text, st.none(),
        st.lists(st.fixed_dictionaries({"type": _field(st.just("text")), "text": _field(_text)}), max_size=3),
    )
)
_message = st.one_of(
    st.fixed_dictionaries({"role": _role, "content": _content}, optional={"name": _field(_text), "extra": JUNK}),
    JUNK,
)
_stop = _field(st.one_of(_text, st.lists(_text, max_size=6)))
_token_ids = st.lists(st.integers(-2, VOCAB + 2), max_size=40)

COMMON = {
    "max_tokens": _field(st.integers(1, SMALL_MAX_TOKENS)),
    "temperature": _field(st.floats(0.0, 2.0)),
    "top_p": _field(st.floats(0.0, 1.0)),
    "top_k": _field(st.integers(-1, 100)),
    "seed": _field(st.integers(0, 2**63 - 1)),
    "stop": _stop,
    "n": _field(st.integers(1, 3)),
    "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({}, optional={"include_usage": _field(st.booleans())})),
    "user": _field(_text),
    "presence_penalty": _field(st.just(0.0)),
    "frequency_penalty": _field(st.just(0)),
    "logprobs": _field(st.just(False)),
}
CHAT_FIELDS = {
    **COMMON,
    "messages": _field(st.lists(_message, min_size=1, max_size=4)),
    "max_completion_tokens": _field(st.integers(1, SMALL_MAX_TOKENS)),
    "tools": _field(st.just([])),
}
COMPLETION_FIELDS = {
    **COMMON,
    "prompt": _field(st.one_of(_text, _token_ids, st.lists(_text, max_size=2), st.lists(_token_ids, max_size=2))),
    "echo": _field(st.just(False)),
    "suffix": _field(st.one_of(st.none(), st.just(""))),
    "best_of": _field(st.sampled_from([None, 1])),
}


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
def bodies(draw: st.DrawFn, fields: dict[str, st.SearchStrategy]) -> bytes:
    model = draw(st.one_of(st.just(MODEL), JUNK))
    body: Any = draw(st.fixed_dictionaries({"model": model}, optional=fields))
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


@pytest.fixture(scope="module")
def fuzz_stats() -> Iterator[dict[str, Counter]]:
    stats: dict[str, Counter] = {}
    yield stats
    for name, counts in stats.items():  # seen with -s: the figures for docs/reliability.md
        print(f"\n{name}: {sum(v for k, v in counts.items() if isinstance(k, int))} requests, statuses {dict(counts)}")


@FUZZ
@given(raw=bodies(CHAT_FIELDS))
def test_fuzz_chat_completions(stack, fuzz_stats, raw: bytes) -> None:
    _fuzz(stack.url, "/v1/chat/completions", raw, fuzz_stats.setdefault("hypothesis chat", Counter()))


@FUZZ
@given(raw=bodies(COMPLETION_FIELDS))
def test_fuzz_completions(stack, fuzz_stats, raw: bytes) -> None:
    _fuzz(stack.url, "/v1/completions", raw, fuzz_stats.setdefault("hypothesis completions", Counter()))


# ---- (b) schemathesis: bodies from the gateway's own OpenAPI schema ---------------------------
def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def _resolves(doc: dict, ref: str) -> bool:
    if not ref.startswith("#/"):
        return True  # not ours to judge
    node: Any = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def hoist_defs(doc: dict) -> dict:
    """The schema with each body's local $defs moved to components/schemas, refs rewritten:
    what the gateway should publish (see test_openapi_refs_resolve)."""
    doc = copy.deepcopy(doc)
    components = doc.setdefault("components", {}).setdefault("schemas", {})

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (v.replace("#/$defs/", "#/components/schemas/") if k == "$ref" and isinstance(v, str) else rewrite(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for item in doc.get("paths", {}).values():
        for op in item.values():
            for media in op.get("requestBody", {}).get("content", {}).values():
                schema = media.get("schema", {})
                components.update(schema.pop("$defs", {}))
                media["schema"] = rewrite(schema)
    for name in list(components):
        components[name] = rewrite(components[name])
    return doc


def test_openapi_refs_resolve(stack) -> None:
    """Every $ref in /openapi.json must resolve, or clients and tools cannot read the request schemas."""
    doc = httpx.get(f"{stack.url}/openapi.json", timeout=30).json()
    broken = sorted({r for r in _refs(doc) if not _resolves(doc, r)})
    assert not broken, f"/openapi.json has $refs that resolve to nothing: {broken}"
    assert _resolves(hoist_defs(doc), "#/components/schemas/ChatMessage")


try:
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )
except ImportError:  # an optional test dependency: part (b) is skipped without it
    schemathesis = None


SCHEMATHESIS_EXAMPLES = 40  # per operation


@pytest.fixture(scope="module")
def api_schema(stack):
    """The live schema, with its body $defs hoisted so schemathesis can generate bodies at all."""
    doc = hoist_defs(httpx.get(f"{stack.url}/openapi.json", timeout=30).json())
    schema = schemathesis.openapi.from_dict(doc)
    schema.location = f"{stack.url}/openapi.json"
    schema.config.phases.update(phases=["examples", "fuzzing"])
    schema.config.max_stream_events = 10_000  # read whole SSE answers: their end is checked
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        max_examples=SCHEMATHESIS_EXAMPLES, no_shrink=True, database="none",
    )
    return schema


def _prepare(case: Any) -> None:
    """Real model name most of the time (else every case is a 404) and small max_tokens."""
    body = case.body
    if isinstance(body, dict):
        if isinstance(body.get("model"), str) and hash(json.dumps(body, sort_keys=True, default=str)) % 4:
            body["model"] = MODEL
        bound_lengths(body)
        n = body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 8 and "max_tokens" not in body:
            body["max_tokens"] = SMALL_MAX_TOKENS  # the server's default (32) times n is slow on CPU


if schemathesis is not None:
    schema_under_test = schemathesis.pytest.from_fixture("api_schema")

    @settings(max_examples=SCHEMATHESIS_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @schema_under_test.include(method="POST").parametrize()
    def test_schemathesis_post(case: Any, stack, fuzz_stats) -> None:
        """POST bodies: never a 5xx, refusals OpenAI-shaped, successes well-formed. Status codes and
        content types are not checked against the schema: it declares only a JSON 200."""
        _prepare(case)
        response = case.call_and_validate(base_url=stack.url, checks=[not_a_server_error], timeout=REQUEST_TIMEOUT_S)
        assert not response.stream_cut_short, "schemathesis did not read the whole stream"
        headers = {k.lower(): v[0] if isinstance(v, list) else v for k, v in response.headers.items()}
        check_answer(case.path, response.status_code, headers, response.content,
                     fuzz_stats.setdefault(f"schemathesis POST {case.path}", Counter()))

    @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @schema_under_test.include(path_regex=r"^/(v1/models|health)$").parametrize()
    def test_schemathesis_get(case: Any, stack) -> None:
        """GETs answer as the schema says (status, content type) and never fail."""
        response = case.call_and_validate(
            base_url=stack.url, timeout=REQUEST_TIMEOUT_S,
            checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance],
        )
        assert response.status_code == 200
        if case.path == "/v1/models":
            assert [m["id"] for m in response.json()["data"]] == [MODEL]
else:
    @pytest.mark.skip(reason="schemathesis is not installed (pip install schemathesis)")
    def test_schemathesis_post() -> None:
        """Placeholder so the skip is visible."""


# ---- (c) hand-picked abuse: refused, OpenAI-shaped, and never routed ---------------------------
def _chat(**kw: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


def _raw_chat(field_json: str, where: str = "content") -> bytes:
    """A chat body with `field_json` spliced in raw (for bytes json.dumps would never write)."""
    slots = {
        "content": '{"model": "%s", "messages": [{"role": "user", "content": %s}], "max_tokens": 4}',
        "model": '{"model": %s, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}',
        "role": '{"model": "%s", "messages": [{"role": %s, "content": "hi"}], "max_tokens": 4}',
        "stop": '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stop": %s}',
        "user": '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "user": %s}',
        "name": '{"model": "%s", "messages": [{"role": "user", "content": "hi", "name": %s}], "max_tokens": 4}',
        "part": '{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}], "max_tokens": 4}',
        "extra": '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "metadata": %s}',
        "stream_options": '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream_options": %s}',
        "tools": '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": %s}',
        "key": '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, %s: 1}',
    }
    template = slots[where]
    text = template % field_json if where == "model" else template % (MODEL, field_json)
    return text.encode("utf-8")


def _raw_completion(prompt_json: bytes) -> bytes:
    return b'{"model": "' + MODEL.encode() + b'", "max_tokens": 4, "prompt": ' + prompt_json + b"}"


def _with_bytes(where: str, bad: bytes) -> bytes:
    """A chat body whose `where` string holds raw bytes that are not UTF-8."""
    return _raw_chat('"@@"', where).replace(b"@@", bad)


INVALID_UTF8 = [b"\xff\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"abc\x80def", b"\xf4\x90\x80\x80", b"\xe2\x82"]
UTF8_CASES: list[tuple[str, str, bytes]] = [
    *[(f"utf8 {where} {bad!r}", "/v1/chat/completions", _with_bytes(where, bad))
      for where in ("content", "role", "stop", "user", "name", "part", "extra") for bad in INVALID_UTF8[:3]],
    *[(f"utf8 {bad!r} in the model", "/v1/chat/completions", _with_bytes("model", bad)) for bad in INVALID_UTF8[3:]],
    ("utf8 in a key", "/v1/chat/completions", _with_bytes("key", b"me\xff")),
    ("utf8 completion prompt", "/v1/completions", _raw_completion(b'"The capital \xff\xfe of"')),
    ("utf8 completion prompt list", "/v1/completions", _raw_completion(b'["ok", "\xed\xa0\x80"]')),
    ("utf16 body", "/v1/chat/completions", json.dumps(_chat()).encode("utf-16")),
]
# Escaped lone surrogates are valid JSON but not valid Unicode: no UTF-8 encoding exists for them.
SURROGATE_CASES: list[tuple[str, str, bytes]] = [
    *[(f"lone surrogate in {where}", "/v1/chat/completions", _raw_chat('"a\\ud800b"', where))
      for where in ("content", "model", "role", "stop", "user", "name", "part")],
    ("lone surrogate in completion prompt", "/v1/completions", _raw_completion(b'"x\\udfffy"')),
]
NESTING_CASES: list[tuple[str, str, bytes]] = [
    *[(f"nesting {depth} in {where}", "/v1/chat/completions", _raw_chat(_nest(depth), where))
      for where in ("content", "stop", "stream_options", "tools", "role") for depth in (300, 5000)],
    # an unknown key is ignored, so only nesting too deep to parse makes it an error
    ("nesting 5000 in an unknown key", "/v1/chat/completions", _raw_chat(_nest(5000), "extra")),
    ("nesting 100000 of objects in extra", "/v1/chat/completions", _raw_chat('{"a": ' * 100000 + "1" + "}" * 100000, "extra")),
    ("nesting 5000 in prompt", "/v1/completions", _raw_completion(_nest(5000).encode())),
    ("nesting 900 in messages", "/v1/chat/completions",
     f'{{"model": "{MODEL}", "messages": {_nest(900)}}}'.encode()),
]
_LONG = "The quick brown fox jumps over the lazy dog, again and again, without ever tiring. " * 40  # ~3.3k chars
OVERSIZE_CASES: list[tuple[str, str, bytes]] = [
    ("1024 long messages", "/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": [{"role": "user", "content": _LONG}] * 1024}).encode()),
    ("1025 messages", "/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 1025}).encode()),
    ("300 messages of 13k chars (4.0 MB)", "/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": [{"role": "assistant", "content": _LONG * 4}] * 300}).encode()),
    ("3.5 MB completion prompt", "/v1/completions",
     json.dumps({"model": MODEL, "max_tokens": 4, "prompt": _LONG * 1050}).encode()),
    ("600k token ids", "/v1/completions",
     json.dumps({"model": MODEL, "max_tokens": 4, "prompt": [17] * 600_000}).encode()),
    ("2049 token ids, one past the context", "/v1/completions",
     json.dumps({"model": MODEL, "max_tokens": 1, "prompt": [17] * 2049}).encode()),
    ("2047 token ids + 2 max_tokens", "/v1/completions",
     json.dumps({"model": MODEL, "max_tokens": 2, "prompt": [17] * 2047}).encode()),
]
ABSURD_CASES: list[tuple[str, str, bytes]] = [
    (f"absurd {name}", "/v1/chat/completions", json.dumps(_chat(**kw)).encode())
    for name, kw in [
        ("top_k=10**18", {"top_k": 10**18}),
        ("top_k=10**30", {"top_k": 10**30}),
        ("top_k=-2", {"top_k": -2}),
        ("seed=-1", {"seed": -1}),
        ("seed=2**64", {"seed": 2**64}),
        ("temperature=1e308", {"temperature": 1e308}),
        ("temperature=-1e308", {"temperature": -1e308}),
        ("top_p=0", {"top_p": 0}),
        ("top_p=1e308", {"top_p": 1e308}),
        ("stop with 100 entries", {"stop": [f"s{i}" for i in range(100)]}),
        ("stop with an empty string", {"stop": ["", "x"]}),
        ("n=1000", {"n": 1000}),
        ("n=-1", {"n": -1}),
        ("max_tokens=2**64", {"max_tokens": 2**64}),
        ("max_completion_tokens=10**30", {"max_completion_tokens": 10**30}),
        ("max_tokens=0", {"max_tokens": 0}),
        ("max_tokens=true", {"max_tokens": True}),
        ("user over 256 chars", {"user": "u" * 1000}),
    ]
] + [
    ("absurd temperature=NaN", "/v1/chat/completions", json.dumps(_chat(temperature=math.nan)).encode()),
    ("absurd top_p=Infinity", "/v1/chat/completions", json.dumps(_chat(top_p=math.inf)).encode()),
    ("absurd temperature=1e999", "/v1/chat/completions",
     json.dumps(_chat(temperature=0.5)).replace("0.5", "1e999").encode()),
    ("absurd frequency_penalty=-Infinity", "/v1/chat/completions",
     json.dumps(_chat(frequency_penalty=-math.inf)).encode()),
]
REFUSED = UTF8_CASES + SURROGATE_CASES + NESTING_CASES + OVERSIZE_CASES + ABSURD_CASES
# Inputs that are valid and must be served, to prove the routing counter is not vacuous.
ACCEPTED = {"2047 token ids + 2 max_tokens"}
for _name in ACCEPTED:
    REFUSED.remove(next(c for c in REFUSED if c[0] == _name))


@pytest.fixture(scope="module")
def refusal_stats() -> Iterator[Counter]:
    stats: Counter = Counter()
    yield stats
    print(f"\nrefusals: {stats['cases']} cases, {stats['4xx']} refused, {stats['routed']} routed, "
          f"{stats['5xx']} 5xx, slowest {stats['slowest_ms']} ms")


@pytest.mark.parametrize("name, path, raw", REFUSED, ids=[c[0] for c in REFUSED])
def test_bad_input_is_refused_before_any_replica(stack, refusal_stats: Counter, name: str, path: str, raw: bytes) -> None:
    before = route_decisions(stack.url)
    t0 = time.monotonic()
    status, _, body = post(stack.url, path, raw)
    elapsed_ms = int((time.monotonic() - t0) * 1000)
    after = route_decisions(stack.url)
    refusal_stats["cases"] += 1
    refusal_stats["slowest_ms"] = max(refusal_stats["slowest_ms"], elapsed_ms)
    refusal_stats["4xx" if 400 <= status < 500 else "5xx" if status >= 500 else "other"] += 1
    refusal_stats["routed"] += after != before
    assert 400 <= status < 500, f"{name}: {status} {body[:300]!r}"
    check_error_body(status, body)
    assert after == before, f"{name}: refused with {status} but {after - before:g} routing decision(s) were made"


def test_routing_counter_sees_an_accepted_request(stack) -> None:
    """The check above means something: a request that fits exactly is routed and served."""
    name, path, raw = next(c for c in OVERSIZE_CASES if c[0] in ACCEPTED)
    before = route_decisions(stack.url)
    status, headers, body = post(stack.url, path, raw)
    assert status == 200, (name, status, body[:300])
    check_completion(body, chat=False)
    assert route_decisions(stack.url) == before + 1


def test_oversized_chunked_body_is_refused(stack) -> None:
    """Without a content-length the size limit still holds (the body is counted as it arrives)."""
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(5 * 16):
            yield b"x" * 2**16  # 5 MiB in all
        yield b'"}]}'

    before = route_decisions(stack.url)
    status, _, body = post(stack.url, "/v1/chat/completions", chunks())
    assert status == 413, (status, body[:300])
    assert check_error_body(status, body)["code"] == "body_too_large"
    assert route_decisions(stack.url) == before
