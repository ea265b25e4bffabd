"""Writes one replica's blocks and load into the shared index; garbage-collects dead replicas.

Used by our replicas' publisher and by the vLLM event adapter alike. Every write keeps two
views in step: the inverted index (block -> replicas, what lookups read) and the replica's
own set (replica -> blocks, what a resync or a clean-up needs to retract). Writes go through
non-transactional pipelines, which a Redis Cluster splits per shard; they are idempotent, so a
write cut short is repaired by the next resync.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.protocol.redis_schema import RedisKeys
from router.redis_index import Client

CHUNK = 5000  # members per SADD/SREM and commands per pipeline flush


class IndexWriter:
    def __init__(self, client: Client, keys: RedisKeys) -> None:
        self.client = client
        self.keys = keys

    async def _run(self, stage) -> list:
        """Pipelines the commands `stage(pipe)` queues, flushing every CHUNK commands."""
        results: list = []
        pipe = self.client.pipeline(transaction=False)
        count = 0
        for _ in stage(pipe):
            count += 1
            if count >= CHUNK:
                results += await pipe.execute()
                pipe = self.client.pipeline(transaction=False)
                count = 0
        if count:
            results += await pipe.execute()
        return results

    def _stage_add(self, pipe, rid: str, hashes: list[int]) -> Iterable[None]:
        for h in hashes:
            pipe.sadd(self.keys.block(h), rid)
            yield
        for i in range(0, len(hashes), CHUNK):
            pipe.sadd(self.keys.blocks(rid), *hashes[i : i + CHUNK])
            yield

    def _stage_remove(self, pipe, rid: str, hashes: list[int]) -> Iterable[None]:
        for h in hashes:
            pipe.srem(self.keys.block(h), rid)
            yield
        for i in range(0, len(hashes), CHUNK):
            pipe.srem(self.keys.blocks(rid), *hashes[i : i + CHUNK])
            yield

    async def apply(self, rid: str, events: list[tuple[str, list[int]]]) -> None:
        """("+", hashes) stored / ("-", hashes) removed, in order."""

        def stage(pipe):
            for op, hashes in events:
                yield from (self._stage_add if op == "+" else self._stage_remove)(pipe, rid, hashes)

        await self._run(stage)

    async def replace(self, rid: str, hashes: Iterable[int], register: bool = True) -> int:
        """Make the index hold exactly `hashes` for this replica (a full resync); returns the
        number of stale entries retracted."""
        new = {int(h) for h in hashes}
        old = {int(h) for h in await self.client.smembers(self.keys.blocks(rid))}
        stale = list(old - new)
        fresh = list(new - old)

        def stage(pipe):
            yield from self._stage_remove(pipe, rid, stale)
            yield from self._stage_add(pipe, rid, fresh)
            if register:
                pipe.sadd(self.keys.replicas, rid)
                yield

        await self._run(stage)
        return len(stale)

    async def retract(self, rid: str) -> bool:
        """Remove every entry of this replica (it stopped, or died). True if this call removed
        it from the registered replicas (two collectors racing both clean, one counts)."""
        await self.replace(rid, (), register=False)  # a late collector must not re-register it

        def stage(pipe):
            pipe.delete(self.keys.blocks(rid))
            pipe.delete(self.keys.heartbeat(rid))
            pipe.srem(self.keys.replicas, rid)
            yield

        *_, unregistered = await self._run(stage)
        return bool(unregistered)

    async def heartbeat(self, rid: str, load: dict[str, int], ttl_ms: int) -> bool:
        """Writes the load; True when the heartbeat had expired (Redis restarted, or garbage
        collection retracted this replica): the caller must then publish everything again."""
        key = self.keys.heartbeat(rid)
        pipe = self.client.pipeline(transaction=False)
        pipe.exists(key)
        pipe.hset(key, mapping=load)
        pipe.pexpire(key, ttl_ms)
        existed, _, _ = await pipe.execute()
        # registered only once the heartbeat exists (on a cluster the two keys live on different
        # shards): a collector must never find a new replica registered without a heartbeat
        await self.client.sadd(self.keys.replicas, rid)
        return not existed

    async def collect_garbage(self, holder: str, lease_ms: int) -> list[str] | None:
        """Retract replicas whose heartbeat expired. At most once per lease period for the
        whole fleet: whoever takes the lease (SET NX PX) does it, the others skip. Returns the
        replicas removed, or None when another process holds the lease."""
        if not await self.client.set(self.keys.gc_lease, holder, nx=True, px=lease_ms):
            return None
        members = sorted(await self.client.smembers(self.keys.replicas))
        if not members:
            return []
        pipe = self.client.pipeline(transaction=False)
        for rid in members:
            pipe.exists(self.keys.heartbeat(rid))
        alive = await pipe.execute()
        dead = [rid for rid, a in zip(members, alive, strict=True) if not a]
        return [rid for rid in dead if await self.retract(rid)]
