"""The router under saturation, in real Ray Serve with real Redis: more concurrent requests than
all replicas accept. Ray calls choose_replicas again and again for a queued request; the
router must look the request up in Redis once (counted with INFO commandstats), route
everything it accepted, and the gateway must answer the overflow with clean 429s."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import redis

from router.protocol.redis_schema import RedisKeys
from tests.helpers.stack import MODEL

MAX_SENT = 400  # a hang guard on the burst: far past the 8 the gateway and replicas take at once


def _evalsha_calls(client: redis.Redis) -> int:
    return client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)


def test_saturation_one_lookup_per_routed_request(stack):
    from ray import serve

    from gateway.config import AppConfig
    from gateway.local_redis import LocalRedis

    prefix = f"sat-{uuid.uuid4().hex[:6]}"
    own = LocalRedis().start()  # a Redis of its own: the count below is server-wide
    config = AppConfig(
        engine="sim", replicas=2, policy="affinity", redis_url=own.url, key_prefix=prefix,
        max_ongoing_requests=2, max_queued_requests=4, max_num_seqs=2, default_max_tokens=32,
        redis_timeout_s=1.0,  # a lookup timed out on a busy machine would route by fallback, uncounted
    )
    name = "saturation"
    if name in serve.status().applications:
        serve.delete(name)
    try:
        _saturate(stack, config, name, own, prefix)
    finally:
        own.cleanup()


def _saturate(stack, config, name: str, own, prefix: str) -> None:
    from ray import serve

    base = stack.deploy(config, name=name, route_prefix="/saturation")
    client = redis.Redis.from_url(own.url, decode_responses=True)
    system = f"Saturation run {prefix}. " + "You answer questions about trains and timetables. " * 8

    async def one(http: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"model": MODEL, "max_tokens": 32, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]}
        return await http.post(f"{base}/v1/chat/completions", json=body, headers={"x-session-id": f"{prefix}-{i}"})

    async def burst() -> list[httpx.Response]:
        """16 at once, then two more for each one answered while none was refused, until one is
        (the load only grows, however fast the replicas answer or slowly the requests arrive)
        or MAX_SENT were sent; every response, in the order sent (index i: session i)."""
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as http:
            sent: list[asyncio.Task] = []

            def send(n: int) -> set[asyncio.Task]:
                new = [asyncio.ensure_future(one(http, i)) for i in range(len(sent), min(len(sent) + n, MAX_SENT))]
                sent.extend(new)
                return set(new)

            pending, refused = send(16), False
            try:
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    refused = refused or any(t.result().status_code == 429 for t in done)
                    if not refused:
                        pending |= send(2 * len(done))
            finally:
                for t in pending:  # a request failed: leave none running into the closed client
                    t.cancel()
            return [t.result() for t in sent]

    try:
        before = _evalsha_calls(client)
        responses = asyncio.run(burst())
        after = _evalsha_calls(client)
    finally:
        serve.delete(name)
    ok = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    print(f"\n{len(responses)} sent: {len(ok)} answered, {len(rejected)} refused")
    assert len(ok) + len(rejected) == len(responses), [(r.status_code, r.text[:200]) for r in responses]
    # 2 replicas x 2 in flight + 4 queued in the router: at least 8 accepted, some turned away
    assert rejected, f"no 429 in {len(responses)} requests: the gateway never refused one"
    assert len(ok) >= 8, (len(ok), len(rejected))
    for r in ok:  # nothing lost: every accepted request ran to its end
        body = r.json()
        assert body["usage"]["completion_tokens"] >= 1
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
    for r in rejected:  # clean 429s: OpenAI-shaped, with a retry hint
        assert r.json()["error"]["type"], r.text
        assert "retry-after" in r.headers
    # one Redis lookup per routed request, however often Ray asked the router while all were busy
    routes = [r.headers.get("x-prefixgate-route") for r in ok]
    assert after - before == len(ok), (after - before, len(ok), routes)
    # side effects once per routed request, for the replica that really took it
    sessions = [client.get(RedisKeys(prefix).session(f"{prefix}-{i}")) for i, r in enumerate(responses) if r.status_code == 200]
    assert all(sessions), sessions


def test_prefix_routing_through_a_redis_cluster(stack, redis_cluster):
    """The whole path on a 3-master Redis Cluster: sim replicas publish through cluster
    pipelines, the router detects the cluster from the same redis:// URL and routes a new
    session with a known system prompt to the replica holding it."""
    from ray import serve

    from gateway.config import AppConfig

    prefix = f"cl-{uuid.uuid4().hex[:6]}"
    # a lookup budget for a loaded CI machine: this test is about routing through the cluster,
    # not about decisions that miss the 50 ms default (those are `stale`, tested elsewhere)
    config = AppConfig(engine="sim", replicas=2, policy="affinity", redis_url=redis_cluster.url, key_prefix=prefix,
                       default_max_tokens=8, redis_timeout_s=1.0)
    name = "cluster"
    if name in serve.status().applications:
        serve.delete(name)
    base = stack.deploy(config, name=name, route_prefix="/cluster")
    # long enough (~400 tokens) that the cache clearly outweighs a load figure that still counts
    # the previous request (heartbeats lag; a 100-token prompt is cheaper to recompute than one
    # queued request's decode weight, and affinity would rightly move it)
    system = f"Cluster run {prefix}. " + "You answer questions about ships and harbours. " * 40
    client = redis_cluster.client()

    def ask(i: int) -> httpx.Response:
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"x-session-id": f"{prefix}-{i}"}, timeout=60)
        assert r.status_code == 200, r.text
        return r

    try:
        home = ask(0).headers["x-prefixgate-replica"]
        deadline = time.monotonic() + 10  # bounded wait for the replica's first publish
        while not client.scard(RedisKeys(prefix).blocks(home)):
            assert time.monotonic() < deadline, "the replica never published its blocks to the cluster"
            time.sleep(0.1)
        for i in range(1, 4):
            r = ask(i)
            assert r.headers["x-prefixgate-replica"] == home, (i, r.headers.get("x-prefixgate-route"), r.headers.get("x-prefixgate-matched-blocks"))
            assert r.headers["x-prefixgate-route"] == "prefix"
        # the index's keys live on more than one shard
        masters = {client.get_node_from_key(k).name for k in client.scan_iter(match=f"{{{prefix}:b*", count=1000)}
        assert len(masters) >= 2, masters
    finally:
        serve.delete(name)
