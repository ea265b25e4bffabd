"""The shared index from a replica's side and a router's: a fake replica (real BlockManager and
publisher, no tensors), polling, direct Redis clients, a router's load table from heartbeats."""

from __future__ import annotations

import asyncio
import time

import redis

from replica.kvcache.block_manager import BlockManager, BlockTable
from replica.serve.publisher import BlockPublisher, PublisherConfig
from router.index.redis_index import IndexUnavailable
from router.protocol.hashing import block_hashes

BS = 4


class FakeReplica:
    """A real BlockManager (tensor-free) with a publisher attached, as a replica has."""

    def __init__(self, url: str, prefix: str, rid: str, num_blocks: int = 16, depth: int = 64, ttl: float = 3.0):
        self.bm = BlockManager(num_blocks, BS)
        self.publisher = BlockPublisher(
            PublisherConfig(url, rid, prefix, depth=depth, flush_s=0.01, heartbeat_s=0.1, heartbeat_ttl_s=ttl, gc_s=0.2),
            snapshot=self._snapshot, load=self._load,
        )
        self.bm.listeners.append(self.publisher)
        self.tables: list[BlockTable] = []

    def _snapshot(self):
        self.publisher.reset_events()
        return self.bm.held_blocks()

    def _load(self):
        return {"running": len(self.tables), "waiting": 0, "pending_prefill_tokens": 0,
                "free_blocks": self.bm.num_free, "cached_blocks": self.bm.num_cached, "capacity_blocks": self.bm.num_blocks}

    def run(self, tokens: list[int], keep: bool = False) -> list[int]:
        t = BlockTable(hashes=block_hashes(tokens, BS, 0))
        self.bm.allocate(t, len(tokens))
        self.bm.commit(t, tokens, len(tokens), 0)
        if keep:
            self.tables.append(t)
        else:
            self.bm.free(t)
        return t.hashes


def sync_client(url: str):
    """A blocking client for direct checks: cluster-aware when the URL names a cluster node."""
    plain = redis.Redis.from_url(url)
    if plain.info("cluster").get("cluster_enabled"):
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url.rsplit("/", 1)[0])
    return plain


async def eventually(check, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = await check()
            if result:
                return result
        except IndexUnavailable:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def _matched(index, hashes, rid, n):
    return (await index.lookup(hashes, [rid], None)).replicas[rid].matched_blocks == n


def loads_from_redis(url: str, prefix: str, replica_ids: list[str]):
    """A router's load table after one refresh from these replicas' heartbeats in a real Redis."""
    from router.index.redis_index import RedisConfig, RedisIndex
    from router.load_table import LoadTable

    async def refreshed() -> LoadTable:
        index = RedisIndex(RedisConfig(url, prefix, timeout_s=0.5))
        loads = LoadTable(index)
        loads.watch(replica_ids)
        await loads.refresh()
        await loads.close()
        await index.close()
        return loads

    return asyncio.run(refreshed())


def vllm_publisher(translator, url: str, prefix: str, rid: str) -> BlockPublisher:
    """A vLLM replica's publisher as replica/backends/vllm_backend.py wires it: the translator's
    held blocks are its resync snapshot, and the translator feeds it (start() it on a loop)."""
    from router.protocol.redis_schema import Heartbeat

    def snapshot():
        publisher.reset_events()
        return translator.held()

    publisher = BlockPublisher(PublisherConfig(url, rid, prefix, flush_s=0.01, heartbeat_s=0.1), snapshot=snapshot,
                               load=lambda: Heartbeat(kv_pull=0))
    return publisher
