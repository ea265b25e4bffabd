"""Faults against the real stack: a replica killed mid-request with Redis stopped, floods beyond
capacity, tenants."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import time
import uuid

import httpx
import pytest
import redis

from gateway.config import AppConfig
from gateway.flow.admission import RETRY_AFTER_MAX_S
from replica.engine import LLMEngine, SamplingParams
from router.protocol.redis_schema import RedisKeys
from tests.helpers.stack import MODEL
from tests.helpers.streams import _assert_well_formed, _stream, _take

STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]


def _heartbeats(config) -> dict[str, dict]:
    client = redis.Redis.from_url(config.redis_url, decode_responses=True)
    prefix = config.key_prefix
    out = {}
    for rid in client.smembers(RedisKeys(prefix).replicas):
        hb = client.hgetall(RedisKeys(prefix).heartbeat(rid))
        if hb:
            out[rid] = hb
    return out


async def _wait(cond, what: str, timeout_s: float) -> None:
    """Wait for a condition; the deadline only guards against a hang (it is not the figure)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


PLAIN = [[{"role": "user", "content": f"Describe {thing} in a long paragraph."}] for thing in ("the sea", "a storm")]


def test_replica_killed_mid_request_loses_nothing(stack, redis_server):
    """SIGKILL the replica serving a greedy stream and two non-streaming requests of the same
    session, and stop Redis right after: every request completes (the gateway continues them
    on the other replica), the stream is identical to an undisturbed run with one [DONE] and
    correct usage, /health answers ok on its first probe after Redis is back, the dead
    replica's index entries go, and its replacement registers and gets traffic."""
    session = f"fault-{uuid.uuid4().hex[:6]}"
    headers = {"x-session-id": session}
    stream_body = {"model": MODEL, "messages": STORY, "max_tokens": 96, "stream": True, "temperature": 0,
                   "stream_options": {"include_usage": True}}
    plain_bodies = [{"model": MODEL, "messages": msgs, "max_tokens": 64, "temperature": 0} for msgs in PLAIN]
    before = set(_heartbeats(stack.config))  # the live replicas before the kill

    async def scenario():
        async with httpx.AsyncClient(timeout=180) as client:
            # undisturbed references (same prompts, greedy)
            reference = await _stream(client, stack.url, stream_body)
            _assert_well_formed(reference)
            plain_ref = [(await client.post(f"{stack.url}/v1/chat/completions", json=b)).json() for b in plain_bodies]
            # the disturbed run
            lines: list[str] = []
            async with client.stream("POST", f"{stack.url}/v1/chat/completions", json=stream_body, headers=headers) as r:
                assert r.status_code == 200
                victim = r.headers["x-prefixgate-replica"]
                pid = int(_heartbeats(stack.config)[victim]["pid"])
                plain = [asyncio.create_task(client.post(f"{stack.url}/v1/chat/completions", json=b, headers=headers))
                         for b in plain_bodies]
                it = r.aiter_lines()
                async for line in it:
                    lines.append(line)
                    if sum(x.startswith("data: {") for x in lines) >= 6:
                        break
                # the session's requests sit on the victim now (or soon): wait until it reports them
                try:
                    await _wait(lambda: int(_heartbeats(stack.config).get(victim, {}).get("running", 0)) >= 3,
                                "the victim to run all three requests", 15)
                except AssertionError:
                    pass  # the router spread them: the stream alone still exercises migration
                os.kill(pid, signal.SIGKILL)
                redis_server.stop()  # and Redis goes away while the requests move
                lines += [line async for line in it]
            disturbed = {"status": 200, "replica": victim, "text": "", "finish": [], "usage": None, "errors": [],
                         "done_at": [], "lines": 0}
            for line in (x for x in lines if x):
                disturbed["lines"] += 1
                if line == "data: [DONE]":
                    disturbed["done_at"].append(disturbed["lines"])
                elif line.startswith("data: "):
                    _take(disturbed, json.loads(line[6:]))
            plain_out = await asyncio.gather(*plain)
            redis_server.start()  # same port
            probe = await client.get(f"{stack.url}/health")
            return reference, disturbed, plain_ref, plain_out, probe, victim

    try:
        reference, disturbed, plain_ref, plain_out, probe, victim = asyncio.run(asyncio.wait_for(scenario(), timeout=300))
    finally:
        if redis_server.pid is None:  # the scenario failed while Redis was down: later tests need it
            redis_server.start()
    _assert_well_formed(disturbed)
    assert disturbed["text"] == reference["text"]
    assert disturbed["finish"] == reference["finish"]
    assert disturbed["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]
    assert disturbed["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    for ref, got in zip(plain_ref, plain_out, strict=True):
        assert got.status_code == 200, got.text
        body = got.json()
        assert body["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    # the first probe after Redis came back already reaches it (a fresh connection, not the stale one)
    assert probe.status_code == 200 and probe.json()["checks"]["redis"] == "ok", probe.text
    # the index: the dead replica stops counting; Serve's replacement registers and gets traffic
    asyncio.run(_wait(lambda: victim not in _heartbeats(stack.config), "the victim's heartbeat to expire", 60))
    new: set[str] = set()

    def two_live() -> bool:
        new.clear()
        new.update(set(_heartbeats(stack.config)) - {victim})
        return len(new) == 2

    asyncio.run(_wait(two_live, "a replacement replica", 180))
    # concurrent cold requests: the load term spreads them, so the replacement must take some
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(
                f"{stack.url}/v1/chat/completions",
                json={"model": MODEL, "max_tokens": 4,
                      "messages": [{"role": "system", "content": f"{uuid.uuid4()}"},
                                   {"role": "user", "content": f"{uuid.uuid4()} New {i}"}]})
                for i in range(8)), return_exceptions=True)

    replacement = new - before
    assert len(replacement) == 1, (new, before)
    # the replacement's heartbeat is in Redis before Serve has told every router about it:
    # bursts until it takes traffic (bounded), each one answered in full by live replicas
    served: set[str] = set()
    for _ in range(6):
        responses = asyncio.run(burst())
        failed = [r for r in responses if isinstance(r, BaseException)]
        assert not failed, (failed, _heartbeats(stack.config))  # which replicas were live, and their load
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
        served |= {r.headers["x-prefixgate-replica"] for r in responses}
        assert served <= new, (served, new)
        if served & replacement:
            break
    assert served & replacement, (served, new, before)


def test_frozen_replica_mid_stream_is_left_behind(stack):
    """SIGSTOP the replica serving a greedy stream: its process lives, so Ray reports no death
    and only the gateway's stall guard (no chunk, not even a keepalive, for stall_timeout_s)
    can notice. The stream continues on the other replica, identical to an undisturbed run
    with one [DONE]; the gateway counts a resumed migration; the replica, resumed (SIGCONT),
    is live again (or replaced by Serve) afterwards."""
    from tests.helpers.metrics import scrape, total

    body = {"model": MODEL, "messages": STORY, "max_tokens": 96, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    headers = {"x-session-id": f"freeze-{uuid.uuid4().hex[:6]}"}
    resumed_before = total(scrape(stack.metrics_port), "ray_prefixgate_migrations_total", outcome="resumed")

    async def scenario():
        async with httpx.AsyncClient(timeout=180) as client:
            reference = await _stream(client, stack.url, body)
            _assert_well_formed(reference)
            frozen: list[int] = []

            def freeze(out: dict) -> None:
                if not frozen and out["lines"] >= 4:
                    frozen.append(int(_heartbeats(stack.config)[out["replica"]]["pid"]))
                    os.kill(frozen[0], signal.SIGSTOP)  # frozen mid-stream, 92 tokens to go

            try:
                out = await _stream(client, stack.url, body, headers, on_line=freeze)
            finally:
                for pid in frozen:
                    os.kill(pid, signal.SIGCONT)
            assert frozen, out  # the fault was injected
            return reference, out

    reference, disturbed = asyncio.run(asyncio.wait_for(scenario(), timeout=300))
    _assert_well_formed(disturbed)
    assert disturbed["text"] == reference["text"] and disturbed["finish"] == reference["finish"]
    assert disturbed["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]

    def resumed() -> bool:
        return total(scrape(stack.metrics_port), "ray_prefixgate_migrations_total", outcome="resumed") > resumed_before

    asyncio.run(_wait(resumed, "the gateway's resumed-migration count (Ray exports every few s)", 90))
    # the stack is whole again for the tests after this one
    asyncio.run(_wait(lambda: len(_heartbeats(stack.config)) == 2, "two live replicas after SIGCONT", 180))


@pytest.fixture(scope="module")
def guarded(stack):
    """A second app beside the default one: API keys (two tenants) and a small queue bound."""
    from ray import serve

    config = AppConfig(
        redis_url=stack.config.redis_url, key_prefix=f"guard-{uuid.uuid4().hex[:6]}", replicas=2,
        kv_cache_mb=64, max_model_len=2048, max_ongoing_requests=2, max_queued_requests=2,
        api_keys={"key-a": "tenant-a", "key-b": "tenant-b"},
    )
    url = stack.deploy(config, name="guarded", route_prefix="/guarded")
    yield url
    serve.delete("guarded")


def test_api_keys_required(guarded):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "key-a"}):
        r = httpx.post(f"{guarded}/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{guarded}/v1/models").status_code == 401
    r = httpx.post(f"{guarded}/v1/chat/completions", json=body, headers={"authorization": "Bearer key-a"}, timeout=60)
    assert r.status_code == 200


def test_tenants_never_share_cached_blocks(guarded):
    secret = [{"role": "system", "content": f"Internal memo {uuid.uuid4()}: the merger closes on Friday. " * 4},
              {"role": "user", "content": "Summarise."}]
    body = {"model": MODEL, "messages": secret, "max_tokens": 4}

    def send(key, session):
        r = httpx.post(f"{guarded}/v1/chat/completions", json=body, timeout=60,
                       headers={"authorization": f"Bearer {key}", "x-session-id": session})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], r.headers["x-prefixgate-replica"]

    send("key-a", "s")
    again, home = send("key-a", "s")
    assert again > 0
    # tenant b, same prompt, same session id string: on a replica where b has not run this
    # prompt, no hit, wherever it lands (a's copy is there); where b has run it, b's own copy hits
    b_ran_on: set[str] = set()
    for i in range(3):
        cached, replica = send("key-b", f"s{i}" if i else "s")
        if replica in b_ran_on:
            assert cached > 0, (i, replica)
        else:
            assert cached == 0, (i, replica, home)
        b_ran_on.add(replica)


def test_engine_salts_isolate_tenants(tiny_model_dirs):
    engine = LLMEngine(tiny_model_dirs["llama"], block_size=4, num_blocks=64)
    prompt = [[7] * 20]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    assert engine.generate(prompt, params, cache_salt="a")[0].num_cached_tokens == 0
    assert engine.generate(prompt, params, cache_salt="b")[0].num_cached_tokens == 0
    assert engine.generate(prompt, params, cache_salt="a")[0].num_cached_tokens == 16


def test_flood_gets_429_and_admitted_requests_finish(guarded):
    headers = {"authorization": "Bearer key-a"}

    async def flood():
        finished = itertools.count()
        async with httpx.AsyncClient(timeout=180) as client:
            async def one(i):
                # 48 tokens whatever the model says: the admitted ones outlast the flood's arrival
                body = {"model": MODEL, "max_tokens": 48, "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"Count to ten, take {i}."}]}
                r = await client.post(f"{guarded}/v1/chat/completions", json=body, headers=headers)
                return r, next(finished)  # the order in which answers arrived
            return await asyncio.gather(*(one(i) for i in range(24)))

    results = asyncio.run(asyncio.wait_for(flood(), timeout=300))
    statuses = [r.status_code for r, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 24 - 6 - 2, statuses  # capacity is 2 replicas x 2 + 2 queued
    assert statuses.count(200) >= 4
    first_200 = min(order for r, order in results if r.status_code == 200)
    for r, order in results:
        if r.status_code == 429:
            # whole seconds until the queue would reach it (gateway/flow/admission.py retry_after_s)
            assert 1 <= int(r.headers["retry-after"]) <= RETRY_AFTER_MAX_S, r.headers
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert order < first_200  # refused at admission, before any admitted request finished
        else:
            assert r.json()["usage"]["completion_tokens"] > 0
