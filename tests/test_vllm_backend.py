"""vLLM replicas behind prefixgate (`--engine vllm`), for real: two replicas of vLLM's CPU engine
(the vLLM venv that `make install` builds, docs/vllm.md) beside the session stack, under the
same gateway and router code. Greedy output equals vLLM serving the prompts alone; routing finds
vLLM's blocks through its KV events; the heartbeat carries vLLM's load and says no pulls; a
replica killed mid-stream loses nothing; bad input gets the same 4xx as on our engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from collections import Counter

import httpx
import psutil
import pytest
import redis
from hypothesis import given, settings

from gateway.config import AppConfig
from replica.backends.vllm_settings import vllm_python
from router.protocol.redis_schema import RedisKeys
from tests.helpers.fuzz import CHAT_FIELDS, COMPLETION_FIELDS, FUZZ, _fuzz, bodies
from tests.helpers.stack import MODEL, side_app
from tests.helpers.streams import _assert_well_formed, _stream, _take

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

NUM_BLOCKS = 96  # per replica, 32-token blocks: 3,072 tokens each
BLOCK = 32
PREAMBLE = ("You are the harbour master's assistant. Answer questions about tides, moorings, pilotage and the "
            "rules of the port precisely and briefly. ") * 6


def _vllm_python() -> str:
    py = vllm_python()
    assert "vllm" in py and os.path.exists(py), f"the vLLM venv is missing ({py}): run `make install` (scripts/bootstrap.sh)"
    return py


@pytest.fixture(scope="module")
def vllm_app(stack):
    """Two vLLM replicas with their own gateway at /vllm, on the session's Ray and Redis."""
    _vllm_python()
    # redis_timeout_s: vLLM's engines load the cores, and a lookup that misses the default 50 ms
    # deadline routes from the router's own memory (`stale`), not from the index these tests read
    config = AppConfig(engine="vllm", replicas=2, num_blocks=NUM_BLOCKS, max_model_len=2048, default_max_tokens=32,
                       redis_url=stack.config.redis_url, key_prefix=f"vllm-{uuid.uuid4().hex[:6]}", policy="affinity",
                       redis_timeout_s=1.0)
    with side_app(stack, "vllm", config) as url:
        yield url, config


def _heartbeats(config) -> dict[str, dict]:
    client = redis.Redis.from_url(config.redis_url, decode_responses=True)
    keys = RedisKeys(config.key_prefix)
    beats = {rid: client.hgetall(keys.heartbeat(rid)) for rid in client.smembers(keys.replicas)}
    return {rid: hb for rid, hb in beats.items() if hb.get("capacity_blocks")}


def _eventually(cond, what: str, timeout_s: float = 120.0):
    """Wait for a condition; the deadline only guards against a hang."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _complete(url: str, prompt, max_tokens: int = 12, **extra) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=180,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_vllm_replicas_publish_load_and_blocks_the_router_routes_by(vllm_app):
    """Both replicas heartbeat vLLM's pool (96 blocks) and kv_pull=0; a prompt's repeat with
    another ending goes to the replica holding its leading blocks (found through vLLM's KV
    events, re-hashed with our spec), and usage reports vLLM's cached tokens."""
    url, config = vllm_app
    beats = _eventually(lambda: (b := _heartbeats(config)) and len(b) == 2 and b, "two vLLM heartbeats")
    for hb in beats.values():
        assert int(hb["capacity_blocks"]) == NUM_BLOCKS and hb["kv_pull"] == "0", hb
        assert int(hb["free_blocks"]) <= NUM_BLOCKS and "running" in hb and "pending_prefill_tokens" in hb
    tag = uuid.uuid4().hex[:8]
    first = _complete(url, f"[{tag}] {PREAMBLE} Question: when is high water?")
    holder = first["prefixgate"]["replica"]
    keys = RedisKeys(config.key_prefix)
    client = redis.Redis.from_url(config.redis_url, decode_responses=True)
    # the holder's cached-block count grows once its events are published
    _eventually(lambda: int(client.hget(keys.heartbeat(holder), "cached_blocks") or 0) >= 3, "the prefix's blocks in the heartbeat", 30)
    hb = client.hgetall(keys.heartbeat(holder))  # vLLM's free queue holds its cached blocks: counted once
    assert int(hb["free_blocks"]) + int(hb["cached_blocks"]) <= NUM_BLOCKS, hb
    again = _complete(url, f"[{tag}] {PREAMBLE} Question: where do pilots board?")
    route = again["prefixgate"]["route"]
    assert again["prefixgate"]["replica"] == holder and route["reason"] == "prefix", route
    assert route["matched_blocks"] >= 3, route
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 3 * BLOCK and cached % BLOCK == 0, again["usage"]
    # vLLM's step timings reach the heartbeat (what the router's latency model learns from)
    steps = _eventually(lambda: (hb := client.hgetall(keys.heartbeat(holder))) and int(hb.get("step_count", 0)) >= 2 and hb,
                        "vLLM's steps in the heartbeat", 30)
    assert int(steps["step_us"]) > 0 and int(steps["step_prefill_tokens"]) > 0 and int(steps["step_rows"]) > 0, steps
    assert int(steps["step_token_budget"]) > 0, steps


def test_greedy_through_prefixgate_equals_vllm_alone(vllm_app, default_model_dir):
    """The same prompts, greedy, through gateway -> router -> vLLM replica and through vLLM's own
    offline engine started alone with the same settings: identical text and token counts."""
    url, _ = vllm_app
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    texts = ["The capital of France is", "Once upon a time, a lighthouse keeper", f"{PREAMBLE} Question: what is a spring tide?"]
    prompts = [tok.encode(t) for t in texts]
    ours = [_complete(url, ids, max_tokens=24, ignore_eos=True) for ids in prompts]
    job = {"model": default_model_dir, "prompts": prompts, "max_tokens": 24, "ignore_eos": True, "block_size": BLOCK,
           "num_blocks": NUM_BLOCKS}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTEST"))}
    done = subprocess.run([_vllm_python(), "-m", "tests.vllm_reference"], input=json.dumps(job), capture_output=True,
                          text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("REFERENCE ")]  # vLLM logs to stdout too
    reference = json.loads(line.removeprefix("REFERENCE "))["outputs"]
    for got, ref_ids in zip(ours, reference, strict=True):
        assert got["usage"]["completion_tokens"] == len(ref_ids)
        assert got["choices"][0]["text"] == tok.decode(ref_ids, skip_special_tokens=True), (got, ref_ids)


BAD = [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 8, "min_tokens": 9}, "min_tokens"),
    ({"prompt": "hi", "max_tokens": 4, "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "hi", "max_tokens": 4, "logprobs": 21}, "logprobs"),
    ({"prompt": [49152], "max_tokens": 4}, "prompt"),
    ({"prompt": "word " * 3000, "max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_schema"}}, "json_schema"),
    ({"prompt": "hi", "max_tokens": 4, "temperature": -1}, "temperature"),
]


@pytest.mark.parametrize("body,what", BAD, ids=[w for _, w in BAD])
def test_bad_input_gets_an_openai_4xx_on_vllm(vllm_app, body, what):
    url, _ = vllm_app
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=120)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error


def test_a_schema_with_integers_beyond_64_bits_is_served_by_vllm(vllm_app):
    """JSON allows any integer, and a schema may hold one in a keyword its grammar ignores; vLLM
    sends a schema dict to its engine core with msgspec, which refuses it: every replica failed
    the request as if its engine had died, a 503 (found by the fuzz test below)."""
    url, _ = vllm_app
    schema = {"type": "object", "x-limits": [6.6e16, 2**64], "": True}
    body = {"model": MODEL, "prompt": [2], "max_tokens": 4, "n": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


def test_json_object_is_served_by_vllm(vllm_app):
    """response_format json_object carries no schema: its conversion to vLLM's parameters read
    one and raised KeyError, so every replica failed the request and it was a 503 (found by the
    chat fuzz test below)."""
    url, _ = vllm_app
    body = {"model": MODEL, "messages": [{"role": "user", "content": "A JSON object, please."}], "max_tokens": 8,
            "response_format": {"type": "json_object"}, "logprobs": True, "stream": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]


def test_logit_bias_steers_vllm_as_our_engine(vllm_app, default_model_dir):
    """logit_bias reaches vLLM's sampler: +100 on a token makes a greedy run produce only it."""
    from transformers import AutoTokenizer

    url, _ = vllm_app
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    word = tok.encode(" harbour")[0]
    body = {"model": MODEL, "prompt": "List the numbers from one to twenty.", "max_tokens": 4, "temperature": 0,
            "logit_bias": {str(word): 100}}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode([word] * 4)


def test_logprobs_of_impossible_tokens_are_json_on_vllm(vllm_app):
    """vLLM reports -inf for a token it made impossible (here under a grammar, top_k and logit
    biases); JSON has no -inf, and the gateway's response failed to encode: a 500 (found by the
    fuzz test below). Such a logprob is LOGPROB_FLOOR, as our engine reports it."""
    url, _ = vllm_app
    body = {"model": MODEL, "prompt": [4918, 13722, 47717, 21934, 1, 447], "max_tokens": 3, "n": 3, "logprobs": 9,
            "logit_bias": {"9858": -42.3, "214": -2.97, "4210": 24.17}, "presence_penalty": 0.46,
            "repetition_penalty": 1.53, "temperature": 1.05, "top_k": 22, "seed": 79460113187, "stop": "C",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "integer"}}}}}}
    for _ in range(3):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            lp = choice["logprobs"]
            assert all(v >= -9999.0 for v in lp["token_logprobs"]), lp
            assert all(v >= -9999.0 for top in lp["top_logprobs"] for v in top.values()), lp


STREAM_FAILURES = r"""
import json, msgspec
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
from replica.backends.vllm_backend import stream_failure

def failed(cause):
    e = EngineGenerateError()
    e.__cause__ = cause
    return e

cases = {
    "encode error, engine alive": (failed(msgspec.EncodeError("Integer value out of range")), True, None),
    "overflow, engine alive": (failed(OverflowError("int too big")), True, None),
    "encode error, engine dead": (failed(msgspec.EncodeError("x")), False, None),
    "encode error, handed off": (failed(msgspec.EncodeError("x")), True, "replica draining"),
    "unknown cause, engine alive": (failed(RuntimeError("boom")), True, None),
    "engine dead": (EngineDeadError(), True, None),
    "vLLM's validation": (VLLMValidationError("bad logprobs"), True, None),
    "a ValueError at add_request": (ValueError("bad"), True, None),
    "anything else": (KeyError("k"), True, None),
}
print(json.dumps({name: [type(r).__name__, str(r)] for name, (e, alive, off) in cases.items()
                  for r in [stream_failure(e, engine_alive=alive, handed_off=off)]}))
"""


def test_a_request_vllm_fails_on_a_live_engine_is_refused_not_retried():
    """vLLM wraps any failure of one request in EngineGenerateError, engine alive or not. Only a
    dead engine (or a replica handing its requests off) sends the request to another replica; a
    value, type or encoding error vLLM hit on this request's data would fail there too, so it is a
    400 at once (it was taken for a dead engine on every replica, then a 503). The exceptions are
    vLLM's own, built in the vLLM venv; the mapping is pure logic."""
    done = subprocess.run([_vllm_python(), "-c", STREAM_FAILURES], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    got = {name: tuple(v) for name, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    assert got["encode error, engine alive"] == (
        "InvalidRequestError", "vLLM could not run this request: EncodeError: Integer value out of range")
    assert got["overflow, engine alive"][0] == "InvalidRequestError"
    assert got["encode error, engine dead"][0] == "EngineDeadError"
    assert got["encode error, handed off"] == ("EngineDeadError", "replica draining")
    assert got["unknown cause, engine alive"] == ("EngineDeadError", "vLLM failed the request: RuntimeError('boom')")
    assert got["engine dead"][0] == "EngineDeadError"
    assert got["vLLM's validation"] == ("InvalidRequestError", "bad logprobs")
    assert got["a ValueError at add_request"] == ("InvalidRequestError", "bad")
    assert got["anything else"] == ("KeyError", "'k'")


@settings(FUZZ, max_examples=6)
@given(raw=bodies(COMPLETION_FIELDS))
def test_fuzz_completions_on_vllm(vllm_app, raw: bytes) -> None:
    _fuzz(vllm_app[0], "/v1/completions", raw, Counter())


@settings(FUZZ, max_examples=6)
@given(raw=bodies(CHAT_FIELDS))
def test_fuzz_chat_on_vllm(vllm_app, raw: bytes) -> None:
    _fuzz(vllm_app[0], "/v1/chat/completions", raw, Counter())


def test_vllm_replica_killed_mid_stream_the_stream_completes_identical(vllm_app):
    """SIGKILL the vLLM replica serving a greedy stream: the gateway continues it on the other
    replica (a longer prompt there), the text equals an undisturbed run, one [DONE], usage right;
    the killed replica's vLLM engine process does not outlive it."""
    url, config = vllm_app
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story about a harbour at night."}],
            "max_tokens": 48, "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as client:
            reference = await _stream(client, url, body)
            _assert_well_formed(reference)
            lines: list[str] = []
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                victim = r.headers["x-prefixgate-replica"]
                pid = int(_heartbeats(config)[victim]["pid"])
                engine_procs = psutil.Process(pid).children(recursive=True)
                it = r.aiter_lines()
                async for line in it:
                    lines.append(line)
                    if sum(x.startswith("data: {") for x in lines) >= 4:
                        break
                os.kill(pid, signal.SIGKILL)
                lines += [line async for line in it]
            return reference, lines, engine_procs

    reference, lines, engine_procs = asyncio.run(asyncio.wait_for(scenario(), timeout=600))
    disturbed = {"status": 200, "text": "", "finish": [], "usage": None, "errors": [], "done_at": [], "lines": 0}
    for line in (x for x in lines if x):
        disturbed["lines"] += 1
        if line == "data: [DONE]":
            disturbed["done_at"].append(disturbed["lines"])
        elif line.startswith("data: "):
            _take(disturbed, json.loads(line[6:]))
    _assert_well_formed(disturbed)
    assert disturbed["text"] == reference["text"]
    assert disturbed["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]
    assert engine_procs, "a vLLM replica runs its engine core in a child process"
    _, alive = psutil.wait_procs(engine_procs, timeout=60)
    assert not alive, f"vLLM engine processes outlived their replica: {alive}"
    # last in the module: no later test waits for Serve's replacement (a vLLM start, about a minute)
