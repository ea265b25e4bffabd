"""The router inside a real Ray Serve app (2 replicas, real Redis): prefix, load, Redis faults."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx

from router.protocol.redis_schema import RedisKeys
from tests.test_gateway_e2e import MODEL, chat

LONG_SYSTEM = (
    "You are the support assistant of Northwind Traders. You answer questions about orders, "
    "shipping, returns and invoices. Be brief, be polite, and never invent order numbers. "
) * 3


def _ask(stack, question, session):
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}]
    r = chat(stack, messages, session, max_tokens=8)
    assert r.status_code == 200, r.text
    return r


def test_new_session_with_known_system_prompt_goes_where_the_prefix_is(stack):
    tag = uuid.uuid4().hex[:6]
    first = _ask(stack, f"Where is my order {tag}?", f"a-{tag}")
    home = first.headers["x-prefixgate-replica"]
    time.sleep(0.3)  # let the replica publish its blocks
    for i in range(3):
        r = _ask(stack, f"How do I return item {i} of {tag}?", f"b{i}-{tag}")
        assert r.headers["x-prefixgate-replica"] == home
        assert r.headers["x-prefixgate-route"] == "prefix"
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


def test_saturated_replica_spreads_load(stack):
    tag = uuid.uuid4().hex[:6]
    system = LONG_SYSTEM + f" Ticket queue {tag}."

    async def one(client, i):
        body = {"model": MODEL, "max_tokens": 48, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: list your rules."}]}
        r = await client.post(f"{stack.url}/v1/chat/completions", json=body, headers={"x-session-id": f"{tag}-{i}"})
        assert r.status_code == 200, r.text
        return r.headers["x-prefixgate-replica"], r.headers["x-prefixgate-route"]

    async def burst():
        async with httpx.AsyncClient(timeout=180) as client:
            await one(client, -1)  # the prefix now lives on one replica
            await asyncio.sleep(0.3)
            return await asyncio.gather(*(one(client, i) for i in range(10)))

    results = asyncio.run(burst())
    replicas = {r for r, _ in results}
    assert len(replicas) == 2, results  # the prefix holder alone would queue all ten


def test_redis_outage_falls_back_then_recovers(stack, redis_server):
    tag = uuid.uuid4().hex[:6]
    system = f"Case {tag}. " + LONG_SYSTEM  # a prompt no replica has seen before the outage

    def ask(question, session):
        r = chat(stack, [{"role": "system", "content": system}, {"role": "user", "content": question}], session, max_tokens=8)
        assert r.status_code == 200, r.text
        return r

    redis_server.stop()
    try:
        routes = [ask(f"Is shipping free for order {i}?", f"down-{tag}").headers for i in range(3)]
        assert {h["x-prefixgate-route"] for h in routes} == {"fallback"}
        # consistent hashing keeps the session on one replica even without the index
        holders = {h["x-prefixgate-replica"] for h in routes}
        assert len(holders) == 1
    finally:
        redis_server.start()
    # blocks computed during the outage were never published as events: only the replicas'
    # resync after the restart can make them routable. Wait for it without sending requests
    # (a probe routed elsewhere would compute the prompt there too).
    import redis

    client = redis.Redis.from_url(stack.config.redis_url)
    (holder,) = holders
    deadline = time.monotonic() + 30
    while not client.exists(RedisKeys(stack.config.key_prefix).blocks(holder)):
        assert time.monotonic() < deadline, "replica did not re-publish its blocks after the restart"
        time.sleep(0.2)
    time.sleep(0.5)  # the other replica's resync too
    r = ask("Can I change my address?", f"up-{tag}")
    assert r.headers["x-prefixgate-route"] == "prefix"
    assert r.headers["x-prefixgate-replica"] == holder
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
