"""The gateway end to end against a real 3-master Redis Cluster.

A second Serve app beside the session's `stack` (same Ray, same HTTP proxy, its own route
prefix): gateway + router + 2 sim-compute replicas whose `redis_url` names one cluster node.
Sim replicas run the real BlockManager, scheduler, publisher and usage accounting, so
`cached_tokens` is the engine's own count; only the forward pass is a modelled sleep, which is
all that keeps this class cheap. The same requests as the standalone gateway tests must see
prefix routes through the index, growing cached tokens, and index keys on several shards.
"""

from __future__ import annotations

import json
import time
import uuid
from types import SimpleNamespace

import httpx
import pytest

from router.protocol.redis_schema import RedisKeys
from tests.helpers.stack import MODEL, chat, side_app, three_turn_session

APP = "e2e-cluster"


@pytest.fixture(scope="module")
def cluster_gateway(stack, redis_cluster):
    """Gateway, router and 2 sim replicas on the cluster; `.url` and `.config` like `stack`."""

    from gateway.config import AppConfig

    prefix = f"e2ecl-{uuid.uuid4().hex[:6]}"
    config = AppConfig(engine="sim", replicas=2, policy="affinity", redis_url=redis_cluster.url, key_prefix=prefix,
                       default_max_tokens=24, max_model_len=2048, redis_timeout_s=1.0)
    with side_app(stack, APP, config) as base:
        yield SimpleNamespace(url=base, config=config, cluster=redis_cluster, keys=RedisKeys(prefix))


def _wait_published(gw, replica: str, timeout_s: float = 15.0) -> None:
    """Until the replica's block set is in the cluster (bounded: a replica that never
    publishes fails the test instead of hanging it)."""
    client = gw.cluster.client()
    deadline = time.monotonic() + timeout_s
    while not client.scard(gw.keys.blocks(replica)):
        assert time.monotonic() < deadline, f"{replica} never published its blocks to the cluster"
        time.sleep(0.1)


def _ask(gw, system: str, question: str, session: str) -> httpx.Response:
    r = chat(gw, [{"role": "system", "content": system}, {"role": "user", "content": question}], session, max_tokens=8)
    assert r.status_code == 200, r.text
    return r


class TestGatewayOnRedisCluster:
    def test_three_turn_session_grows_cache_and_stays_home(self, cluster_gateway):
        """The standalone test's assertions, unchanged, through the cluster."""
        three_turn_session(cluster_gateway)
        sessions = list(cluster_gateway.cluster.client().scan_iter(match=cluster_gateway.keys.session("*"), count=1000))
        assert sessions, "the router wrote no session key to the cluster"

    def test_new_session_with_known_system_prompt_hits_the_prefix(self, cluster_gateway):
        tag = uuid.uuid4().hex[:6]
        system = f"Harbour office {tag}. " + "You answer questions about ships, berths and tides. " * 8
        home = _ask(cluster_gateway, system, "When is high tide?", f"a-{tag}").headers["x-prefixgate-replica"]
        _wait_published(cluster_gateway, home)
        for i in range(3):
            r = _ask(cluster_gateway, system, f"Which berth for ship {i}?", f"b{i}-{tag}")
            assert r.headers["x-prefixgate-replica"] == home
            assert r.headers["x-prefixgate-route"] == "prefix"
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64

    def test_streaming_usage_reports_cached_tokens(self, cluster_gateway):
        # long enough that its cache outweighs a load figure still counting the first run, and one
        # session: the point here is the usage the stream reports, not a close routing call
        tag = uuid.uuid4().hex[:6]
        messages = [{"role": "user", "content": f"Stream {tag}: " + "list the planets in order. " * 24}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True}}
        usages = []
        for _ in range(2):
            with httpx.stream("POST", f"{cluster_gateway.url}/v1/chat/completions", json=body,
                              headers={"x-session-id": f"stream-{tag}"}, timeout=60) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            usages.append(json.loads(lines[-2].removeprefix("data: "))["usage"])
        assert usages[0]["prompt_tokens"] == usages[1]["prompt_tokens"] >= 64
        # the second run of the same prompt finds every full block of it cached
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= usages[1]["prompt_tokens"] - 16

    def test_token_id_prompts_route_by_prefix(self, cluster_gateway):
        """/v1/completions with token ids: the router hashes the same ids the replica caches."""
        base = [1000 + (i * 7919) % 40000 for i in range(160)]  # 10 full blocks, no chat template
        first = httpx.post(f"{cluster_gateway.url}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": base + [5], "max_tokens": 4})
        assert first.status_code == 200, first.text
        home = first.headers["x-prefixgate-replica"]
        _wait_published(cluster_gateway, home)
        r = httpx.post(f"{cluster_gateway.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": base + [6, 7], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.headers["x-prefixgate-replica"] == home and r.headers["x-prefixgate-route"] == "prefix"
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 160

    def test_index_keys_span_at_least_two_shards(self, cluster_gateway):
        """The block index that requests through this gateway publish lies on more than one
        master (its own prompts, so the test stands alone)."""
        tag = uuid.uuid4().hex[:6]
        replicas = {_ask(cluster_gateway, f"Shard check {tag}-{i}. " + "Tell me about lighthouses. " * 6, "Why?",
                         f"shard-{tag}-{i}").headers["x-prefixgate-replica"] for i in range(3)}
        for replica in replicas:
            _wait_published(cluster_gateway, replica)
        client = cluster_gateway.cluster.client()
        keys = list(client.scan_iter(match=f"{{{cluster_gateway.config.key_prefix}:b*", count=1000))
        masters = {client.get_node_from_key(k).name for k in keys}
        assert len(masters) >= 2, masters
