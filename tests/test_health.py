"""Health that tells the present: a probe after a Redis restart reconnects, problems are
named, liveness is apart from readiness, and a stack that never gets ready says why."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import httpx
import pytest

from gateway.config import AppConfig
from gateway.health import check_redis
from gateway.local_redis import LocalRedis


def test_first_probe_after_a_redis_restart_reconnects():
    server = LocalRedis().start()
    gw = SimpleNamespace(config=SimpleNamespace(redis_url=server.url), _redis=None)
    try:
        async def probe():
            return await check_redis(gw)

        loop = asyncio.new_event_loop()
        try:
            assert loop.run_until_complete(probe()) is None
            pooled = gw._redis
            server.restart()  # same port: the pooled connection is now stale
            assert loop.run_until_complete(probe()) is None  # the very first probe after it
            assert gw._redis is not pooled
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
        assert r.status_code == 200 and body["status"] == "ok", body
        assert body["checks"]["redis"] == "ok" and body["checks"]["replicas"] == "ok"


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
