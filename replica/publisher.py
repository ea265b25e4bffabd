"""Publishes a replica's cached block hashes and load to Redis, off the engine's step loop.

The engine calls stored/removed/cleared from its step thread; those only append to a queue.
A background asyncio task drains it in pipelined batches, beats a heartbeat (load, short TTL)
and garbage-collects replicas whose heartbeat expired. If Redis is slow or down, events are
dropped with a counter and the full current set is re-published once Redis answers again.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from router.protocol.redis_schema import GC_SCRIPT, RedisKeys
from router.redis_index import connect

log = logging.getLogger("prefixgate.publisher")


@dataclass
class PublisherConfig:
    redis_url: str
    replica_id: str
    key_prefix: str = "prefixgate"
    depth: int = 64  # publish only the leading blocks of each prompt (64 x 16 = 1024 tokens)
    flush_s: float = 0.02
    heartbeat_s: float = 0.5
    heartbeat_ttl_s: float = 3.0
    gc_s: float = 5.0
    timeout_s: float = 0.5
    max_backlog: int = 200_000  # events held while Redis is away before dropping to a resync


@dataclass
class PublisherStats:
    published: int = 0
    dropped: int = 0
    resyncs: int = 0
    errors: int = 0
    connected: bool = False
    extra: dict = field(default_factory=dict)


class BlockPublisher:
    def __init__(
        self,
        config: PublisherConfig,
        snapshot: Callable[[], list[tuple[int, int]]],
        load: Callable[[], dict[str, int]],
    ) -> None:
        """snapshot() returns (hash, position) of every cached block and must call
        take_snapshot_events() atomically with it (under the engine's lock)."""
        self.config = config
        self.keys = RedisKeys(config.key_prefix)
        self._snapshot = snapshot
        self._load = load
        self._events: collections.deque[tuple[str, list[int]]] = collections.deque()
        self._backlog = 0
        self._lock = threading.Lock()
        self._resync = True
        self.stats = PublisherStats()
        self._task: asyncio.Task | None = None
        self._client: aioredis.Redis | None = None

    # ---- KVEventListener (engine thread) -------------------------------------------------
    def stored(self, hashes: list[int], positions: list[int]) -> None:
        keep = [h for h, p in zip(hashes, positions, strict=True) if p < self.config.depth]
        if keep:
            self._push("+", keep)

    def removed(self, hashes: list[int]) -> None:
        self._push("-", hashes)

    def cleared(self) -> None:
        with self._lock:
            self._events.clear()
            self._backlog = 0
            self._resync = True

    def _push(self, op: str, hashes: list[int]) -> None:
        with self._lock:
            if self._backlog >= self.config.max_backlog:
                self.stats.dropped += len(hashes)
                self._resync = True
                return
            self._events.append((op, hashes))
            self._backlog += len(hashes)

    def reset_events(self) -> None:
        """Called with the engine paused, right after taking a snapshot."""
        with self._lock:
            self._events.clear()
            self._backlog = 0

    # ---- background task -----------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, unregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            # bounded: a Redis call stuck in a socket must not hang the replica's shutdown
            await asyncio.wait({self._task}, timeout=self.config.timeout_s * 4)
        if unregister and self._client is not None:
            try:
                keys = self.keys.heartbeat(self.config.replica_id), self.keys.blocks(self.config.replica_id)
                await asyncio.wait_for(self._client.delete(*keys), self.config.timeout_s * 2)
            except Exception:  # Redis away: the heartbeat TTL and GC clean up instead
                pass
        if self._client is not None:
            try:
                await asyncio.wait_for(self._client.aclose(), self.config.timeout_s * 2)
            except Exception:
                pass

    async def _run(self) -> None:
        self._client = connect(self.config.redis_url, self.config.timeout_s)
        gc = self._client.register_script(GC_SCRIPT)
        loop = asyncio.get_running_loop()
        next_beat = next_gc = 0.0
        bound = self.config.timeout_s * 4  # no Redis call may hang the loop (e.g. a stuck TLS handshake)
        while True:
            try:
                if self._resync:
                    await asyncio.wait_for(self._full_resync(), bound)
                await asyncio.wait_for(self._flush(), bound)
                now = loop.time()
                if now >= next_beat:
                    await asyncio.wait_for(self._heartbeat(), bound)
                    next_beat = now + self.config.heartbeat_s
                if now >= next_gc:
                    await asyncio.wait_for(gc(args=[self.config.key_prefix]), bound)
                    next_gc = now + self.config.gc_s
                self.stats.connected = True
                await asyncio.sleep(self.config.flush_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis errors, timeouts, anything: never let publishing die
                self.stats.errors += 1
                if self.stats.connected:
                    log.warning("redis unavailable (%r); will resync when it is back", e)
                self.stats.connected = False
                self._resync = True
                with self._lock:  # events are stale once a resync is due
                    self.stats.dropped += self._backlog
                    self._events.clear()
                    self._backlog = 0
                await asyncio.sleep(min(1.0, self.config.heartbeat_s * 2))

    async def _full_resync(self) -> None:
        snapshot = self._snapshot()  # also clears queued events, atomically with the engine
        if inspect.isawaitable(snapshot):  # the replica takes it between engine steps
            snapshot = await snapshot
        hashes = [h for h, p in snapshot if p < self.config.depth]
        rid = self.config.replica_id
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self.keys.blocks(rid))
        for i in range(0, len(hashes), 5000):
            pipe.sadd(self.keys.blocks(rid), *hashes[i : i + 5000])
        pipe.sadd(self.keys.replicas, rid)
        await pipe.execute()
        await self._heartbeat()
        self._resync = False
        self.stats.resyncs += 1
        self.stats.published += len(hashes)

    async def _flush(self) -> None:
        with self._lock:
            batch = list(self._events)
            self._events.clear()
            self._backlog = 0
        if not batch:
            return
        key = self.keys.blocks(self.config.replica_id)
        pipe = self._client.pipeline(transaction=False)
        for op, hashes in batch:
            (pipe.sadd if op == "+" else pipe.srem)(key, *hashes)
        await pipe.execute()
        self.stats.published += sum(len(h) for _, h in batch)

    async def _heartbeat(self) -> None:
        rid = self.config.replica_id
        key = self.keys.heartbeat(rid)
        load = self._load()
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(key, mapping=load)
        pipe.pexpire(key, int(self.config.heartbeat_ttl_s * 1000))
        pipe.sadd(self.keys.replicas, rid)
        created, _, _ = await pipe.execute()
        if created == len(load) and not self._resync:
            # The heartbeat was gone: Redis restarted, or we were silent long enough for
            # garbage collection to drop our blocks. Either way, publish everything again.
            self._resync = True
