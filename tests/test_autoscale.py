"""Autoscaling under load in real Ray Serve with simulated-compute replicas: 2 -> 3 -> 2 with
every request answered in full, and the index left holding exactly the live replicas."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import redis

from router.protocol.redis_schema import RedisKeys
from tests.helpers.stack import MODEL

AUTOSCALING = {"min_replicas": 2, "max_replicas": 3, "target_ongoing_requests": 2, "upscale_delay_s": 0.5,
               "downscale_delay_s": 2.0, "metrics_interval_s": 0.5, "look_back_period_s": 1.0}


def _running(app: str) -> int:
    from ray import serve

    dep = serve.status().applications[app].deployments["PrefixCacheReplica"]
    return int((dep.replica_states or {}).get("RUNNING", 0))


async def _request(http: httpx.AsyncClient, base: str, i: int, stream: bool, system: str) -> dict:
    body = {"model": MODEL, "max_tokens": 48, "temperature": 0, "stream": stream,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]}
    headers = {"x-session-id": f"s{i % 6}"}
    if not stream:
        r = await http.post(f"{base}/v1/chat/completions", json=body, headers=headers)
        ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return {"ok": ok, "detail": r.text[:300], "migrations": len(r.json().get("prefixgate", {}).get("migrations", [])) if ok else 0}
    finish, done, errors = [], 0, []
    async with http.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return {"ok": False, "detail": (await r.aread())[:300]}
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"])
                else:
                    finish += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
    return {"ok": done == 1 and not errors and len(finish) == 1, "detail": (finish, done, errors), "migrations": 0}


def test_scale_2_3_2_under_load_loses_nothing(stack):
    from ray import serve

    from gateway.config import AppConfig

    prefix = f"auto-{uuid.uuid4().hex[:6]}"
    name = "autoscale"
    config = AppConfig(engine="sim", policy="affinity", redis_url=stack.config.redis_url, key_prefix=prefix,
                       autoscaling=AUTOSCALING, drain_timeout_s=3, max_ongoing_requests=16, max_queued_requests=64,
                       default_max_tokens=48)
    if name in serve.status().applications:
        serve.delete(name)
    base = stack.deploy(config, name=name, route_prefix=f"/{name}")
    system = f"Autoscale run {prefix}. You answer questions about ships. " * 6
    seen: list[int] = []

    async def run() -> list[dict]:
        results: list[dict] = []
        async with httpx.AsyncClient(timeout=120) as http:
            async def wave(n: int, start: int) -> None:
                results.extend(await asyncio.gather(*(_request(http, base, start + i, i % 2 == 0, system) for i in range(n))))

            async def watch(until) -> None:
                deadline = time.monotonic() + 120  # guards against a hang only
                while not until():
                    seen.append(await asyncio.to_thread(_running, name))
                    assert time.monotonic() < deadline, f"replica counts seen: {seen}"
                    await asyncio.sleep(0.25)

            # heavy load until Serve runs a third replica
            i = 0
            heavy = asyncio.create_task(watch(lambda: 3 in seen))
            while not heavy.done():
                await wave(12, i)
                i += 12
            await heavy
            # light load (2 in flight) until it is back to 2: requests still run while one drains
            light = asyncio.create_task(watch(lambda: seen[-1:] == [2] and 3 in seen))
            while not light.done():
                await wave(2, i)
                i += 2
            await light
        return results

    try:
        results = asyncio.run(asyncio.wait_for(run(), timeout=240))
        assert 3 in seen and seen[-1] == 2, seen
        failed = [r for r in results if not r["ok"]]
        assert not failed and len(results) >= 14, failed[:3]
        # the index holds exactly the live replicas: the removed one retracted its entries
        client = redis.Redis.from_url(stack.config.redis_url, decode_responses=True)
        keys = RedisKeys(prefix)
        deadline = time.monotonic() + 30  # a killed (not drained) replica waits for garbage collection
        while True:
            live = {rid for rid in client.smembers(keys.replicas) if client.exists(keys.heartbeat(rid))}
            registered = client.smembers(keys.replicas)
            holders = set()
            for key in client.scan_iter(match=keys.block_pattern, count=1000):
                holders |= client.smembers(key)
            if len(live) == 2 and registered == live and holders <= live:
                break
            assert time.monotonic() < deadline, (live, registered, holders)
            time.sleep(0.25)
        assert holders, "the live replicas' blocks are indexed"
    finally:
        serve.delete(name)


def test_autoscale_config_file_builds():
    """infra/serve-autoscale.yaml's args are AppConfig fields and build an app (no Ray needed)."""
    from pathlib import Path

    import yaml

    from gateway.app import build_app
    from gateway.config import AppConfig

    doc = yaml.safe_load((Path(__file__).resolve().parents[1] / "infra" / "serve-autoscale.yaml").read_text())
    config = AppConfig.from_dict(doc["applications"][0]["args"])
    assert config.autoscaling["min_replicas"] <= config.autoscaling["max_replicas"]
    build_app(config)
