"""The pull hint through real Ray Serve: affinity-pull decides in the RequestRouter, the hint
rides in the GenerateRequest Ray serialises to the replica, and the replica acts on it.

A second Serve app beside the session's `stack` (same Ray and HTTP proxy, its own route prefix):
gateway + PrefixGateRouter(affinity-pull) + 2 sim-compute replicas on the session's Redis. Sim
replicas run the real BlockManager, scheduler and publisher; a hinted pull inserts the blocks
as if computed (replica/backends/sim_engine.py), so `cached_tokens` on a replica that never computed the
prefix proves the hint arrived.
"""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace

import httpx
import pytest
import redis

from router.protocol.redis_schema import RedisKeys
from tests.helpers.stack import MODEL, side_app

APP = "pull-sim"
BLOCK = 16


@pytest.fixture(scope="module")
def pull_gateway(stack, redis_server):

    from gateway.config import AppConfig

    prefix = f"pull-{uuid.uuid4().hex[:6]}"
    # the pricing of before the default's tuning (docs/simulator.md, "After"): one running request
    # on the holder already outweighs a pull, so one long request makes the holder "busy"
    config = AppConfig(engine="sim", replicas=2, policy="affinity-pull", redis_url=redis_server.url, key_prefix=prefix,
                       default_max_tokens=16, max_model_len=2048, redis_timeout_s=1.0,
                       policy_options={"miss_weight": 8.0, "copy_weight": 1.0})
    with side_app(stack, APP, config) as base:
        yield SimpleNamespace(url=base, keys=RedisKeys(prefix), redis=redis.Redis.from_url(redis_server.url, decode_responses=True))


def _until(cond, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _complete(gw, prompt: list[int], max_tokens: int, session: str | None = None) -> httpx.Response:
    headers = {"x-session-id": session} if session else {}
    r = httpx.post(f"{gw.url}/v1/completions", timeout=120, headers=headers,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r


def test_busy_holder_means_the_other_replica_pulls_the_prefix(pull_gateway):
    gw = pull_gateway
    base = [1000 + (i * 7919 + 13) % 40000 for i in range(8 * BLOCK)]  # 8 full blocks
    session = f"busy-{uuid.uuid4().hex[:6]}"  # the long request follows the first to the holder by its session
    first = _complete(gw, base + [5], 1, session)
    holder = first.headers["x-prefixgate-replica"]
    _until(lambda: gw.redis.scard(gw.keys.blocks(holder)) >= 8, "the holder's blocks in the index")
    # heartbeats carry what the router prices pulls with (sim: its modelled rates and K/V size)
    hb = _until(lambda: gw.redis.hgetall(gw.keys.heartbeat(holder)) or None, "the holder's heartbeat")
    assert int(hb["kv_bytes_per_token"]) > 0 and int(hb["kv_pull_bytes_per_s"]) > 0

    # a long request on the same prefix keeps the holder busy decoding (~6 s of modelled steps)
    long_done = threading.Event()
    long_reply: dict = {}

    def long_request() -> None:
        try:
            long_reply["r"] = _complete(gw, base + [6], 240, session)
        finally:
            long_done.set()

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    try:
        _until(lambda: int(gw.redis.hget(gw.keys.heartbeat(holder), "running") or 0) >= 1 or long_done.is_set(),
               "the holder running the long request")
        assert not long_done.is_set(), f"the long request ended before the holder's heartbeat showed it: {long_reply}"
        r = _complete(gw, base + [7], 1)
        other = r.headers["x-prefixgate-replica"]
        assert other != holder
        assert r.headers["x-prefixgate-route"] == "pull"
        # the other replica never computed the prefix: its 8 blocks came with the hint
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BLOCK
        # ... and are in its cache as if computed: published to the index under its id
        _until(lambda: gw.redis.scard(gw.keys.blocks(other)) >= 8, "the pulled blocks in the index")
    finally:
        assert long_done.wait(120), "the long request never finished"
        t.join(5)
    assert long_reply["r"].headers["x-prefixgate-replica"] == holder
