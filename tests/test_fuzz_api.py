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
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from tests.helpers.fuzz import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    FUZZ,
    REQUEST_TIMEOUT_S,
    SMALL_MAX_TOKENS,
    _fuzz,
    bodies,
    bound_lengths,
    check_answer,
    check_completion,
    check_error_body,
    post,
    route_decisions,
)
from tests.helpers.stack import MODEL

pytestmark = pytest.mark.slow

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


import schemathesis  # noqa: E402  (a test dependency, pyproject's test extra)
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

SCHEMATHESIS_EXAMPLES = 14  # per POST operation, positive and negative cases mixed


@pytest.fixture(scope="module")
def api_schema(stack):
    """The live schema, with its body $defs hoisted so schemathesis can generate bodies at all.

    Cases are drawn with APIOperation.as_strategy under plain hypothesis: schemathesis's own
    pytest integration (schemathesis.pytest.from_fixture) fails on pytest 9 ('Function' object
    has no attribute '_nodeid').
    """
    doc = hoist_defs(httpx.get(f"{stack.url}/openapi.json", timeout=30).json())
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.max_stream_events = 10_000  # read whole SSE answers: their end is checked
    return schema


def _prepare(case: Any) -> None:
    """Real model name most of the time (else nearly every case is a 404) and small max_tokens."""
    body = case.body
    if isinstance(body, dict):
        if isinstance(body.get("model"), str) and zlib.crc32(repr(body).encode("utf-8", "replace")) % 4:
            body["model"] = MODEL
        bound_lengths(body)
        n = body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 8 and "max_tokens" not in body:
            body["max_tokens"] = SMALL_MAX_TOKENS  # the server's default (32) times n is slow on CPU


def _cases(schema: Any, path: str, method: str) -> st.SearchStrategy:
    op = schema[path][method]
    return st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_schemathesis_post(stack, api_schema, fuzz_stats, path: str) -> None:
    """Bodies from the schema, valid and not: never a 5xx, refusals OpenAI-shaped, successes
    well-formed. Status codes and content types are not held to the schema: it declares only a
    JSON 200 (no 4xx, no text/event-stream)."""
    stats = fuzz_stats.setdefault(f"schemathesis POST {path}", Counter())

    @settings(FUZZ, max_examples=SCHEMATHESIS_EXAMPLES)
    @given(case=_cases(api_schema, path, "POST"))
    def run(case: Any) -> None:
        _prepare(case)
        note(repr(case.body)[:2000])
        response = case.call_and_validate(base_url=stack.url, checks=[not_a_server_error], timeout=REQUEST_TIMEOUT_S)
        note(f"-> {response.status_code} {response.content[:500]!r}")
        assert not response.stream_cut_short, "schemathesis did not read the whole stream"
        headers = {k.lower(): v[0] if isinstance(v, list) else v for k, v in response.headers.items()}
        check_answer(path, response.status_code, headers, response.content, stats)

    run()


@pytest.mark.parametrize("path", ["/v1/models", "/health"])
def test_schemathesis_get(stack, api_schema, path: str) -> None:
    """GETs answer as the schema says (status, content type, body schema) and never fail."""

    @settings(FUZZ, max_examples=6)
    @given(case=_cases(api_schema, path, "GET"))
    def run(case: Any) -> None:
        response = case.call_and_validate(
            base_url=stack.url, timeout=REQUEST_TIMEOUT_S,
            checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance],
        )
        assert response.status_code == 200
        if path == "/v1/models":
            assert [m["id"] for m in response.json()["data"]] == [MODEL]

    run()


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
]
# b"\xed\xa0\x80" above is a UTF-16 surrogate encoded as if it were a character: invalid UTF-8
# (RFC 3629), though Python's json.loads(bytes) decodes it with "surrogatepass". The same
# surrogates written as JSON escapes are valid JSON but not valid Unicode: no UTF-8 exists for them.
# Refusing them or serving them are both fine; a 5xx or a non-JSON error is not.
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
    ("2046 token ids + 3 max_tokens, one past the context", "/v1/completions",
     json.dumps({"model": MODEL, "max_tokens": 3, "prompt": [17] * 2046}).encode()),
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
REFUSED = UTF8_CASES + NESTING_CASES + OVERSIZE_CASES + ABSURD_CASES


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


@pytest.mark.parametrize("name, path, raw", SURROGATE_CASES, ids=[c[0] for c in SURROGATE_CASES])
def test_escaped_lone_surrogates_never_break_the_server(stack, name: str, path: str, raw: bytes) -> None:
    before = route_decisions(stack.url)
    status, headers, body = post(stack.url, path, raw)
    after = route_decisions(stack.url)
    assert status < 500, f"{name}: {status} {body[:300]!r}"
    if status == 200:
        check_completion(body, chat=path.endswith("chat/completions"))
    else:
        check_error_body(status, body)
        assert after == before, f"{name}: refused with {status} after {after - before:g} routing decision(s)"


def test_routing_counter_sees_an_accepted_request(stack) -> None:
    """The checks above mean something: a valid request is routed (once) and served."""
    raw = json.dumps({"model": MODEL, "max_tokens": 2, "prompt": [17] * 500}).encode()
    before = route_decisions(stack.url)
    status, _, body = post(stack.url, "/v1/completions", raw)
    assert status == 200, (status, body[:300])
    check_completion(body, chat=False)
    assert route_decisions(stack.url) == before + 1


def test_prompt_beyond_a_replica_pool_is_refused_before_routing(stack) -> None:
    """A prompt inside the model's context but larger than a replica's whole K/V pool can never
    run: the gateway should refuse it itself, as it does prompts beyond the context."""
    from tests.helpers.stack import _replica_loads

    deadline = time.monotonic() + 10
    while not (loads := _replica_loads(stack)) and time.monotonic() < deadline:
        time.sleep(0.5)
    capacity = min(int(ld["capacity_blocks"]) for ld in loads) * stack.config.block_size
    context = stack.config.max_model_len
    if capacity + 8 >= context:
        pytest.skip(f"the pool ({capacity} tokens) holds a whole context ({context}) in this config")
    raw = json.dumps({"model": MODEL, "max_tokens": 4, "prompt": [17] * (capacity + 1)}).encode()
    before = route_decisions(stack.url)
    status, _, body = post(stack.url, "/v1/completions", raw)
    after = route_decisions(stack.url)
    assert 400 <= status < 500, (status, body[:300])
    check_error_body(status, body)
    assert after == before, (f"a {capacity + 1}-token prompt (pool: {capacity} tokens) was routed to a replica "
                             f"before being refused: {body[:200]!r}")


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
