"""Pulls between two real Serve replicas of the real model (the session `stack`).

Requests go to a chosen replica through its actor (replica/kv_io/kv_pull.py's ReplicaCaller, the
call Serve's handles make), so the test decides who holds a prefix and who pulls it. Greedy
output after a pull must equal the holder's own cold computation; the pulled blocks must reach
the index like computed ones; a pull that cannot succeed (holder lacks the blocks, holder
unknown, holder killed mid-pull) must leave a request that completes with the same output.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import pytest
import redis

from replica.kv_io.kv_pull import ReplicaCaller
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.messages import (
    DeltaChunk,
    EndChunk,
    ErrorChunk,
    GenerateRequest,
    KvSource,
    RouteDecision,
    decode_chunk,
)
from router.protocol.redis_schema import RedisKeys
from router.protocol.sampling import SamplingParams
from tests.helpers.stack import side_app

BLOCK = 16
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _caller() -> ReplicaCaller:
    from ray.serve._private.common import DeploymentID

    from gateway.stack import APP_NAME

    return ReplicaCaller(DeploymentID(name="PrefixCacheReplica", app_name=APP_NAME))


def _wait(cond, what: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _live(stack) -> dict[str, dict]:
    """Replica id -> heartbeat, for replicas beating now."""
    keys = RedisKeys(stack.config.key_prefix)
    client = redis.Redis.from_url(stack.config.redis_url, decode_responses=True)
    out = {}
    for rid in client.smembers(keys.replicas):
        hb = client.hgetall(keys.heartbeat(rid))
        if hb:
            out[rid] = hb
    return out


def _pair(stack) -> tuple[str, str]:
    live = _wait(lambda: (lambda x: x if len(x) == 2 else None)(_live(stack)), "two live replicas", 180)
    a, b = sorted(live)
    return a, b


def _prompt(n: int) -> list[int]:
    rng = random.Random(os.urandom(8))  # fresh every run: nothing of it is cached yet
    return [rng.randrange(200, 40000) for _ in range(n)]


def _generate(caller: ReplicaCaller, rid: str, call: tuple[GenerateRequest, RouteDecision | None]) -> tuple[list[int], EndChunk]:
    """Stream one request from replica `rid`, its route beside it as the router passes it:
    (output token ids, end chunk)."""
    import ray

    req, route = call
    actor = asyncio.run(caller._actor(rid))
    gen = actor.handle_request_streaming.options(num_returns="streaming").remote(
        caller.metadata("generate", True), req, route=route)
    tokens: list[int] = []
    end: EndChunk | None = None
    for ref in gen:
        chunk = decode_chunk(ray.get(ref, timeout=120))
        assert not isinstance(chunk, ErrorChunk), chunk
        if isinstance(chunk, DeltaChunk):
            tokens += chunk.token_ids
        elif isinstance(chunk, EndChunk):
            end = chunk
    assert end is not None, "the stream ended without an end chunk"
    return tokens, end


def _stats(caller: ReplicaCaller, rid: str) -> dict:
    return asyncio.run(caller.call(rid, "info"))["stats"]["kv_pull"]


def _request(prompt: list[int], source: KvSource | None = None) -> tuple[GenerateRequest, RouteDecision | None]:
    """A greedy request, and a route carrying the pull hint `source` (as our router sends it)."""
    route = RouteDecision("affinity-pull", "pull", "test", 0, source) if source is not None else None
    return GenerateRequest(prompt_token_ids=list(prompt), params=SamplingParams(**GREEDY)), route


@pytest.fixture(scope="module")
def caller(stack) -> ReplicaCaller:
    return _caller()


def test_pull_between_replicas_matches_recompute_and_reaches_the_index(stack, caller):
    a, b = _pair(stack)
    prompt = _prompt(20 * BLOCK + 5)
    reference, cold = _generate(caller, a, _request(prompt))  # a computes it and holds it now
    assert cold.cached_tokens == 0
    before = _stats(caller, b)
    assert before["transport"] == "ray-object-store"

    pulled, end = _generate(caller, b, _request(prompt, KvSource(a, 20)))
    assert pulled == reference
    assert end.cached_tokens == 20 * BLOCK  # the pulled blocks count as cache hits
    after = _stats(caller, b)
    assert after["ok"] == before["ok"] + 1
    assert after["pulled_blocks"] == before["pulled_blocks"] + 20
    info = asyncio.run(caller.call(b, "info"))
    per_block = info["stats"]["kv_pull"]["pulled_bytes"] - before["pulled_bytes"]
    assert per_block == 20 * 30 * 2 * 3 * 64 * 4 * BLOCK  # SmolLM2-135M: 30 layers, 3 K/V heads, fp32
    assert after["latency_p50_s"] is not None and after["bytes_per_s"] > 0

    # the import went through the normal listener path: b's blocks in the index include them
    keys = RedisKeys(stack.config.key_prefix)
    client = redis.Redis.from_url(stack.config.redis_url, decode_responses=True)
    hashes = block_hashes(prompt, BLOCK, chain_seed(info["model_id"]))[:20]
    _wait(lambda: {str(h) for h in hashes} <= client.smembers(keys.blocks(b)), "b's pulled blocks in the index", 30)
    assert all(b in client.smembers(keys.block(h)) for h in hashes)
    # and the measured rates reach the heartbeat, where the router's pricing reads them
    _wait(lambda: int(_live(stack)[b].get("kv_pull_bytes_per_s", 0)) > 0, "the pull rate in b's heartbeat", 30)

    # a second request for the same prompt on b is a local hit: no second pull
    again, end2 = _generate(caller, b, _request(prompt, KvSource(a, 20)))
    assert again == reference and end2.cached_tokens == 20 * BLOCK
    assert _stats(caller, b)["skipped"] == after["skipped"] + 1


def test_pull_metrics_reach_the_ray_scrape(stack, caller):
    """prefixgate_kv_pull_* through Ray's metrics: pulls by outcome, bytes and latency per pull."""
    from tests.helpers.metrics import scrape, total

    a, b = _pair(stack)
    prompt = _prompt(20 * BLOCK + 5)  # one pull of its own (the suite may run in any order)
    _generate(caller, a, _request(prompt))
    assert _generate(caller, b, _request(prompt, KvSource(a, 20)))[1].cached_tokens == 20 * BLOCK
    stats = [_stats(caller, rid) for rid in (a, b)]
    ok = sum(st["ok"] for st in stats)
    assert ok >= 1
    # the replicas' own totals: the default policy pulls during other tests too, of any length
    pulled_bytes = sum(st["pulled_bytes"] for st in stats)
    pulled_blocks = sum(st["pulled_blocks"] for st in stats)
    exported_bytes = sum(st["exported_bytes"] for st in stats)
    assert pulled_bytes >= 20 * 30 * 2 * 3 * 64 * 4 * BLOCK  # this pull's: 20 blocks x 30 layers x K,V x 3 heads x 64 x fp32

    def exported():
        """Every figure asserted below, each exported by its own replica on its own clock (the
        holder's export counter lags the puller's pull counter): wait for all of them."""
        s = scrape(stack.metrics_port)
        if not (total(s, "ray_prefixgate_kv_pulls_total", outcome="ok") >= ok
                and total(s, "ray_prefixgate_kv_pull_latency_seconds_count") >= ok
                and total(s, "ray_prefixgate_kv_pull_bytes_sum") >= pulled_bytes
                and total(s, "ray_prefixgate_kv_pull_blocks_total") >= pulled_blocks
                and total(s, "ray_prefixgate_kv_export_bytes_total") >= exported_bytes
                and any(labels.get("outcome") == "timeout"  # exported at 0 before any timeout
                        for labels, _ in s.get("ray_prefixgate_kv_pulls_total", []))):
            return None
        return s

    # the deadline only guards against a hang: the condition is every figure above
    assert _wait(exported, "the pull and export metrics in the scrape (Ray exports about every 10 s)", 120)


def test_pull_that_cannot_succeed_recomputes(stack, caller):
    a, b = _pair(stack)
    before = _stats(caller, b)
    # the hinted holder does not have the blocks (evicted, or a stale index): empty answer
    lacking = _prompt(10 * BLOCK + 3)
    got, end = _generate(caller, b, _request(lacking, KvSource(a, 10)))
    assert end.cached_tokens == 0
    # no such replica: the lookup fails
    unknown = _prompt(10 * BLOCK + 3)
    got2, end2 = _generate(caller, b, _request(unknown, KvSource("no-such-replica", 10)))
    assert end2.cached_tokens == 0
    after = _stats(caller, b)
    assert after["empty"] == before["empty"] + 1 and after["failed"] == before["failed"] + 1
    # both outputs are what a plain cold computation gives (on the other replica)
    assert _generate(caller, a, _request(lacking))[0] == got
    assert _generate(caller, a, _request(unknown))[0] == got2


def test_holder_killed_mid_pull_still_completes(stack, caller):
    """The holder is frozen (SIGSTOP) so the pull is surely in flight, then SIGKILLed: the
    request falls back to recompute and gives the holder's own output; Serve replaces it."""
    a, b = _pair(stack)
    prompt = _prompt(12 * BLOCK + 7)
    reference, _ = _generate(caller, a, _request(prompt))
    pid = int(_live(stack)[a]["pid"])
    before = _stats(caller, b)
    result: dict = {}

    def pull() -> None:
        try:
            result["out"] = _generate(caller, b, _request(prompt, KvSource(a, 12)))
        except BaseException as e:  # reported below
            result["error"] = e

    os.kill(pid, signal.SIGSTOP)
    try:
        worker = threading.Thread(target=pull, daemon=True)
        worker.start()
        _wait(lambda: _stats(caller, b)["pulls"] > before["pulls"], "b to start pulling from the frozen holder", 60)
    finally:
        os.kill(pid, signal.SIGKILL)
    worker.join(timeout=180)
    assert not worker.is_alive(), "the request never finished"
    assert "error" not in result, result.get("error")
    tokens, end = result["out"]
    assert tokens == reference and end.cached_tokens == 0
    after = _stats(caller, b)
    assert after["failed"] + after["timeouts"] == before["failed"] + before["timeouts"] + 1
    assert after["ok"] == before["ok"]
    # leave two live replicas for the tests after this one
    _wait(lambda: a not in _live(stack), "the killed holder's heartbeat to expire", 60)
    _wait(lambda: len(_live(stack)) == 2, "Serve's replacement replica", 240)


# ---- the whole path: gateway -> affinity-pull router -> real replica pulling from the holder ----
PULL_APP = "pull-model"


@pytest.fixture(scope="module")
def pull_app(stack, redis_server):
    """A second app beside the session's: gateway, PrefixGateRouter(affinity-pull), 2 replicas
    of the real model, on the session's Redis under its own key prefix."""
    import uuid
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentID

    from gateway.config import AppConfig

    prefix = f"pullm-{uuid.uuid4().hex[:6]}"
    config = AppConfig(replicas=2, policy="affinity-pull", redis_url=redis_server.url, key_prefix=prefix,
                       kv_cache_mb=256, max_model_len=4096, default_max_tokens=16, redis_timeout_s=1.0,
                       kv_pull_timeout_s=120.0)  # the pull itself is under test: a loaded machine must not time it out
    with side_app(stack, PULL_APP, config) as base:
        yield SimpleNamespace(url=base, keys=RedisKeys(prefix),
                              redis=redis.Redis.from_url(redis_server.url, decode_responses=True),
                              caller=ReplicaCaller(DeploymentID(name="PrefixCacheReplica", app_name=PULL_APP)))


def _complete(app, prompt: list[int], max_tokens: int):
    import httpx

    r = httpx.post(f"{app.url}/v1/completions", timeout=180,
                   json={"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_router_hint_makes_a_real_replica_pull(pull_app):
    """A replica busy prefilling a long prompt (3,700 tokens, eight chunks: several seconds here)
    has published the prompt's first chunk of blocks: affinity-pull sends the next request on
    that prefix to the other replica with a hint, and that replica pulls the K/V for real. The
    prompt was 1,500 tokens: its prefill once ended (a fresh clone on a loaded machine) before
    the test had read the first chunk in the index and routed beside it."""
    app = pull_app
    base = _prompt(20 * BLOCK)
    hashes = [str(h) for h in block_hashes(base, BLOCK, chain_seed("SmolLM2-135M-Instruct"))]
    done = threading.Event()
    reply: dict = {}

    def long_request() -> None:
        try:
            reply["r"] = _complete(app, base + _prompt(3400), 1)
        except BaseException as e:  # reported below
            reply["error"] = e
        finally:
            done.set()

    def holder() -> str | None:
        for rid in app.redis.smembers(app.keys.replicas):
            if set(hashes) <= app.redis.smembers(app.keys.blocks(rid)):
                return rid
        return "" if done.is_set() else None

    worker = threading.Thread(target=long_request, daemon=True)
    worker.start()
    try:
        busy = _wait(holder, "the long prompt's first chunk in the index", 120)
        assert busy and not done.is_set(), ("the long prefill ended before the test could route beside it", reply)
        # the router prices the holder's queue from its heartbeat: wait for a beat that shows
        # the long prefill still pending, then for the next one (beats every 0.5 s; the router
        # reads them every 0.1 s), so the decision sees the holder busy. Routing on the index
        # alone sent the request to the holder ('prefix') in a fresh clone's loaded suite
        beat = app.keys.heartbeat(busy)

        def pending_beat() -> int | None:
            hb = app.redis.hgetall(beat)
            return int(hb.get("step_count", 0)) if int(hb.get("pending_prefill_tokens", 0)) >= 1000 else None

        seen = _wait(pending_beat, "the holder's heartbeat with the long prefill pending", 60)
        _wait(lambda: (pending_beat() or 0) > seen or done.is_set(), "a later heartbeat with it still pending", 60)
        assert not done.is_set(), ("the long prefill ended before the test could route beside it", reply)
        # the router weighs the holder's queue against a pull with the rates the replicas measured;
        # in a fresh clone's loaded suite it twice judged waiting for the holder cheaper for the
        # first probe ('prefix'), so up to 5 probes are sent while the long prefill runs: each one
        # either waits for the holder or is sent beside it with a hint, and the first hinted one
        # must pull for real
        for _ in range(5):
            r = _complete(app, base + [7], 1)
            other = r.headers["x-prefixgate-replica"]
            if r.headers["x-prefixgate-route"] == "pull" or done.is_set():
                break
            assert other == busy and r.headers["x-prefixgate-route"] == "prefix", dict(r.headers)
        assert other != busy and r.headers["x-prefixgate-route"] == "pull", dict(r.headers)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 20 * BLOCK
        stats = asyncio.run(app.caller.call(other, "info"))["stats"]["kv_pull"]
        assert stats["ok"] == 1 and stats["pulled_blocks"] == 20
    finally:
        assert done.wait(300), "the long request never finished"
        worker.join(5)
    assert "error" not in reply, reply["error"]
    assert reply["r"].headers["x-prefixgate-replica"] == busy
