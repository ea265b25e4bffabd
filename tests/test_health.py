"""Health that tells the present: a probe after a Redis restart reconnects, problems are
named, liveness is apart from readiness, and a stack that never gets ready says why."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from types import SimpleNamespace

import httpx
import pytest
import redis

from gateway.config import AppConfig
from gateway.health import check_redis
from gateway.local_redis import LocalRedis
from replica.default_model import DEFAULT_MODEL_NAME
from router.protocol.redis_schema import RedisKeys
from tests.helpers.stack import side_app


@pytest.mark.redis  # a redis-server of its own, restarted
def test_first_probe_after_a_redis_restart_reconnects():
    server = LocalRedis().start()
    gw = SimpleNamespace(config=SimpleNamespace(redis_url=server.url), _redis=None)
    try:
        async def probe():
            return await check_redis(gw)

        loop = asyncio.new_event_loop()
        try:
            assert loop.run_until_complete(probe()) is None
            server.restart()  # same port: the pooled connection is now stale
            # the very first probe after it answers: redis-py's own retry reconnects the pooled
            # client, or check_redis replaces it (which of the two depends on whether the restart's
            # close reached the socket before the ping: either is a reconnect, not a stale answer)
            assert loop.run_until_complete(probe()) is None
            server.stop()
            problem = loop.run_until_complete(probe())
            assert problem is not None and f"127.0.0.1:{server.port}" in problem and "unreachable" in problem
            server.start()
            assert loop.run_until_complete(probe()) is None
        finally:
            loop.close()
    finally:
        server.cleanup()


def test_liveness_and_readiness(stack):
    assert httpx.get(f"{stack.url}/health/live", timeout=10).json() == {"status": "ok"}
    for path in ("/health", "/health/ready"):
        r = httpx.get(f"{stack.url}{path}", timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "ok" and body["routing"] == "index", body
        assert body["checks"]["redis"] == "ok" and body["checks"]["replicas"] == "ok" and body["causes"] == []


def test_stack_that_never_gets_ready_says_why(stack, tmp_path):
    """A replica whose model directory does not exist: deploy gives up with a report naming the
    deployment and the replica's error, not a bare timeout."""
    from ray import serve

    from gateway.startup import StackNotReady

    missing = tmp_path / f"no-such-model-{uuid.uuid4().hex[:6]}"
    config = AppConfig(redis_url=stack.config.redis_url, key_prefix=f"broken-{uuid.uuid4().hex[:6]}",
                       replicas=1, model=str(missing), model_name="broken", kv_cache_mb=16)
    try:
        with pytest.raises(StackNotReady) as info:
            stack.deploy(config, timeout_s=25, name="broken", route_prefix="/broken")
        report = str(info.value)
        assert "deployment broken/" in report, report  # names the deployment that failed...
        assert missing.name in report, report  # ...and the replica's error (the missing model)
        assert "redis at" in report and ": ok" in report
    finally:
        serve.delete("broken")


# ---- Redis away: routing degrades, serving does not ------------------------------------------
def _wait_for(cond, what: str, timeout_s: float):
    """Poll until cond() is truthy; the deadline only guards against a hang."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def _health(url: str) -> tuple[int, dict]:
    r = httpx.get(f"{url}/health", timeout=30)
    return r.status_code, r.json()


def _ask(url: str, i: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={"x-session-id": f"s{i % 5}"},
                      json={"model": DEFAULT_MODEL_NAME, "max_tokens": 4,
                            "messages": [{"role": "user", "content": f"Question {i}: where is the index?"}]})


@pytest.fixture(scope="module")
def own_redis():
    """A Redis of this module's own, not started yet: the app below starts without it, and the
    outage test stops it without touching the session's Redis."""
    server = LocalRedis()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def redisless(stack, own_redis):
    config = AppConfig(redis_url=own_redis.url, key_prefix=f"away-{uuid.uuid4().hex[:6]}", replicas=2,
                       engine="sim", num_blocks=256, block_size=16, default_max_tokens=4, max_model_len=4096)
    with side_app(stack, "redisless", config) as url:  # returns once it answers /health with 200
        yield url, config


def test_stack_starts_and_serves_while_redis_is_away(redisless, own_redis):
    """Deployed against a Redis that is not running: it comes up (no 300 s wait for the index),
    /health says 200 `degraded` with `routing: local` naming Redis, and requests are served.
    Once Redis starts, both replicas register and /health says `ok` with `routing: index`."""
    url, config = redisless
    if own_redis.pid is not None:  # the outage test ran first (a shuffled order) and left it up
        own_redis.stop()
    status, body = _health(url)
    assert status == 200 and body["status"] == "degraded" and body["routing"] == "local", body
    assert body["checks"] == {"redis": "unreachable", "replicas": "ok", "serve": "ok"}, body
    assert any("redis unreachable" in c and f":{own_redis.port}" in c for c in body["causes"]), body
    for i in range(4):
        r = _ask(url, i)
        assert r.status_code == 200, r.text
    own_redis.start()
    keys = RedisKeys(config.key_prefix)
    client = redis.Redis.from_url(own_redis.url, decode_responses=True)
    _wait_for(lambda: len(client.smembers(keys.replicas)) == 2, "both replicas to register once Redis is up", 60)
    _wait_for(lambda: _health(url)[1]["status"] == "ok", "/health to say ok once Redis is up", 60)
    status, body = _health(url)
    assert status == 200 and body["routing"] == "index" and body["causes"] == [], body


def test_redis_stopped_under_load_keeps_every_probe_ready(redisless, own_redis):
    """Redis stopped for 20 s while 4 clients send requests and /health is probed every 0.25 s:
    every probe is 200, each probe during the outage names `degraded` and Redis, and no request
    fails; after Redis is back the probes say `ok` again."""
    url, _ = redisless
    if own_redis.pid is None:  # the test above starts it; alone, this one does
        own_redis.start()
    _wait_for(lambda: _health(url)[1]["status"] == "ok", "/health ok before the outage", 60)
    outage = threading.Event()
    stop = threading.Event()
    failures: list[str] = []
    served = [0]
    probes: list[tuple[bool, int, dict]] = []  # (during the outage, status, body)

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            try:
                r = _ask(url, i)
                if r.status_code != 200:
                    failures.append(f"{r.status_code}: {r.text[:200]}")
                else:
                    served[0] += 1
            except httpx.HTTPError as e:
                failures.append(repr(e))
            i += 4

    def prober() -> None:
        while not stop.is_set():
            down = outage.is_set()
            try:
                status, body = _health(url)
            except httpx.HTTPError as e:
                status, body = 0, {"error": repr(e)}
            probes.append((down and outage.is_set(), status, body))
            time.sleep(0.25)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
    threads.append(threading.Thread(target=prober, daemon=True))
    for t in threads:
        t.start()
    try:
        _wait_for(lambda: served[0] >= 8, "the load to be running", 60)
        own_redis.stop()
        outage.set()
        at_stop = served[0]
        time.sleep(20)  # the outage's length (the scenario), not a threshold
        during_outage = served[0] - at_stop
        outage.clear()
        own_redis.start()  # same port
        _wait_for(lambda: probes and probes[-1][2].get("status") == "ok", "/health ok after Redis is back", 60)
    finally:
        stop.set()
        for t in threads:
            t.join(90)
        if own_redis.pid is None:
            own_redis.start()
    during = [p for p in probes if p[0]]
    assert not failures, failures[:5]
    assert all(status == 200 for _, status, _ in probes), [p for p in probes if p[1] != 200][:3]
    assert during and all(b["status"] == "degraded" and b["routing"] == "local" and b["checks"]["redis"] == "unreachable"
                          for _, _, b in during), [b for _, _, b in during if b.get("status") != "degraded"][:3]
    assert during_outage > 0  # requests were served during the outage, not only around it
