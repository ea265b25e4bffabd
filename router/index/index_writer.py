"""Writes one replica's blocks and load into the shared index; garbage-collects dead replicas.

Used by every replica's publisher (replica/serve/publisher.py), whichever engine it runs. Every write keeps two
views in step: the inverted index (block -> replicas, what lookups read) and the replica's
own set (replica -> blocks, what a resync or a clean-up needs to retract). Each write names
the medium the blocks live in (router/protocol/media.py): the inverted index holds
`member(rid, medium)`, the replica's set `entry(hash, medium)`, so a retract or a resync can
remove a lower tier's members too. Writes go through non-transactional pipelines, which a Redis
Cluster splits per shard; they are idempotent, so a write cut short is repaired by the next
resync.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.index.redis_index import Client
from router.protocol.media import MEDIA, check_replica_id, entry, member, split_entry
from router.protocol.redis_schema import RedisKeys

CHUNK = 5000  # members per SADD/SREM and commands per pipeline flush

Event = tuple[str, list[int], str]  # ("+" stored / "-" removed, block hashes, their medium)


def _check_medium(medium: str) -> str:
    """An unknown medium would be written as a member no lookup decodes: refuse it."""
    if medium not in MEDIA:
        raise ValueError(f"unknown medium {medium!r} (one of {MEDIA})")
    return medium


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

    def _stage(self, pipe, rid: str, op: str, hashes: list[int], medium: str) -> Iterable[None]:
        """SADD ("+") or SREM ("-") `hashes` in `medium` on both views."""
        write = pipe.sadd if op == "+" else pipe.srem
        holder = member(rid, medium)
        for h in hashes:
            write(self.keys.block(h), holder)
            yield
        entries = [entry(h, medium) for h in hashes]
        for i in range(0, len(entries), CHUNK):
            write(self.keys.blocks(rid), *entries[i : i + CHUNK])
            yield

    async def apply(self, rid: str, events: list[Event]) -> None:
        """("+", hashes, medium) stored / ("-", hashes, medium) removed, in order. A block that
        moves between tiers comes as its removal from one medium, then its store in the other."""
        check_replica_id(rid)
        for _, _, medium in events:  # before anything is written
            _check_medium(medium)

        def stage(pipe):
            for op, hashes, medium in events:
                yield from self._stage(pipe, rid, op, hashes, medium)

        await self._run(stage)

    async def replace(self, rid: str, blocks: Iterable[tuple[int, str]], register: bool = True) -> int:
        """Make the index hold exactly `blocks` ((hash, medium) pairs; a hash given twice keeps
        its last medium) for this replica: a full resync. Returns the number of stale entries
        retracted (a block now in another medium counts as one)."""
        new = {int(h): _check_medium(m) for h, m in blocks}
        if new:
            check_replica_id(rid)
        old = {split_entry(v) for v in await self.client.smembers(self.keys.blocks(rid))}
        stale = _by_medium(b for b in old if new.get(b[0]) != b[1])
        fresh = _by_medium(b for b in new.items() if b not in old)

        def stage(pipe):
            for medium, hashes in stale.items():
                yield from self._stage(pipe, rid, "-", hashes, medium)
            for medium, hashes in fresh.items():
                yield from self._stage(pipe, rid, "+", hashes, medium)
            if register:
                pipe.sadd(self.keys.replicas, rid)
                yield

        await self._run(stage)
        return sum(len(h) for h in stale.values())

    async def retract(self, rid: str) -> bool:
        """Remove every entry of this replica, in every medium (it stopped, or died). True if
        this call removed it from the registered replicas (two collectors racing both clean, one
        counts)."""
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


def _by_medium(blocks: Iterable[tuple[int, str]]) -> dict[str, list[int]]:
    """(hash, medium) pairs -> hashes per medium (one SADD/SREM batch each)."""
    out: dict[str, list[int]] = {}
    for h, medium in blocks:
        out.setdefault(medium, []).append(h)
    return out
