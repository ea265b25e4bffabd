"""Priority inside the replica, on a live stack (a simulated-compute replica, real Serve, Redis,
HTTP): with flow control off, requests wait in the replica's own queue, and a `priority`
request leaves it before the `flex` requests that were there first.

Every wait is on an event (the replica's heartbeat in Redis, response headers), never on time."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import redis

from gateway.config import AppConfig
from replica.default_model import DEFAULT_MODEL_NAME
from router.protocol.redis_schema import RedisKeys
from tests.helpers.stack import side_app

FLEX = 4  # one runs (max_num_seqs 1), three wait in the replica


def _body(prompt: str, max_tokens: int, **kw) -> dict:
    return {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, **kw}


def test_a_priority_request_leaves_the_replicas_queue_before_earlier_flex_ones(stack):
    prefix = f"prio-{uuid.uuid4().hex[:6]}"
    config = AppConfig(
        redis_url=stack.config.redis_url, key_prefix=prefix, engine="sim", replicas=1, num_blocks=512,
        block_size=16, max_model_len=4096, max_num_seqs=1, max_ongoing_requests=16, redis_timeout_s=1.0,
        sim_service={"decode_step_s": 0.03},  # a flex request decodes for 3 s: the urgent one's way in
    )
    keys = RedisKeys(prefix)
    client = redis.Redis.from_url(stack.config.redis_url, decode_responses=True)
    started: list[str] = []  # first tokens, in the order they arrived

    def waiting() -> int:
        return max((int(client.hget(keys.heartbeat(r), "waiting") or 0) for r in client.smembers(keys.replicas)),
                   default=0)

    async def one(http: httpx.AsyncClient, url: str, name: str, max_tokens: int, **kw) -> None:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=_body(f"{name}: hello", max_tokens, **kw)) as r:
            assert r.status_code == 200, await r.aread()
            started.append(name)  # the headers come with the first token
            async for _ in r.aiter_lines():
                pass

    async def run(url: str) -> int:
        async with httpx.AsyncClient(timeout=300) as http:
            flex = [asyncio.create_task(one(http, url, f"flex-{i}", 100, service_tier="flex")) for i in range(FLEX)]
            deadline = time.monotonic() + 120  # guards a hang only
            while waiting() < FLEX - 1:
                assert time.monotonic() < deadline, "the flex requests never queued in the replica"
                await asyncio.sleep(0.02)
            before = len(started)
            await one(http, url, "urgent", 2, priority=-1)  # vLLM's integer priority: the priority tier
            await asyncio.gather(*flex)
            return before

    with side_app(stack, "prio", config) as url:
        before = asyncio.run(run(url))
    after = started[before:]
    flex_first = after[: after.index("urgent")]
    # FIFO would start all three waiting flex requests first; by priority, at most the one admitted
    # while the urgent request was on its way
    assert len(flex_first) <= 1 < FLEX - 1, started
    assert sorted(started) == sorted([f"flex-{i}" for i in range(FLEX)] + ["urgent"])
