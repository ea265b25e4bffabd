"""Publishes a replica's cached block hashes and load to Redis, off the engine's step loop.

The engine calls stored/removed/cleared from its step thread; those only append to a queue.
A background asyncio task drains it in pipelined batches into the shared index (through
router.index.index_writer), beats a heartbeat (load, short TTL) and takes part in the fleet's
garbage collection (one replica per period, by lease). If Redis is slow or down, events are
dropped with a counter and the full current set is re-published once Redis answers again.

Resyncs are ordered by a generation counter: every reason to resync (start, cleared(), a
dropped event, a lost heartbeat) bumps `_wanted`; a resync records the generation it started
from and only marks that one done, so a cleared() during a resync triggers another.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from router.index.index_writer import IndexWriter
from router.index.redis_index import Client, open_client
from router.protocol.media import DEVICE, check_replica_id
from router.protocol.redis_schema import DEFAULT_KEY_PREFIX, INDEX_BUCKETS, Heartbeat, RedisKeys
from router.router_options import PUBLISH_DEPTH

log = logging.getLogger("prefixgate.publisher")


@dataclass
class PublisherConfig:
    redis_url: str
    replica_id: str
    key_prefix: str = DEFAULT_KEY_PREFIX
    depth: int = PUBLISH_DEPTH  # publish only the leading blocks of each prompt (64 x 16 = 1024 tokens)
    flush_s: float = 0.02
    heartbeat_s: float = 0.5
    # a request arriving or finishing beats at the next flush, at most once per this: routers'
    # load tables (refreshed every 0.1 s) then see an idle replica idle within about 0.15 s,
    # not up to heartbeat_s + 0.1 s later (a holder priced as busy by a request already done)
    beat_on_change_s: float = 0.05
    heartbeat_ttl_s: float = 3.0
    gc_s: float = 1.0  # the fleet collects garbage once per period, whatever its size
    timeout_s: float = 0.5
    max_backlog: int = 200_000  # events held while Redis is away before dropping to a resync
    buckets: int = INDEX_BUCKETS  # must match the routers' (RedisConfig.buckets)


@dataclass
class PublisherStats:
    published: int = 0
    dropped: int = 0
    resyncs: int = 0
    errors: int = 0
    collected: int = 0  # dead replicas this one garbage-collected
    connected: bool = False
    extra: dict = field(default_factory=dict)


class BlockPublisher:
    def __init__(
        self,
        config: PublisherConfig,
        snapshot: Callable[[], list[tuple[int, int, str]]],
        load: Callable[[], Heartbeat | dict[str, int]],
    ) -> None:
        """snapshot() returns (hash, position, medium) of every block held in any tier (or an
        awaitable of it) and must call reset_events() atomically with taking it (under the
        engine's lock)."""
        check_replica_id(config.replica_id)
        self.config = config
        self.keys = RedisKeys(config.key_prefix, config.buckets)
        self._snapshot = snapshot
        self._load = load
        self._events: collections.deque[tuple[str, list[int], str]] = collections.deque()
        self._backlog = 0
        self._lock = threading.Lock()
        self._wanted = 1  # resync generations requested / completed
        self._done = 0
        self._holder = f"{config.replica_id}/{uuid.uuid4().hex[:8]}"
        self.stats = PublisherStats()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._client: Client | None = None
        self._load_changed = False  # a request arrived or finished since the last heartbeat
        self.beats = 0  # heartbeats written (tests wait on it)
        self.rounds = 0  # passes of the publishing loop, each followed by a flush_s pause (tests wait on it)

    @property
    def resync_due(self) -> bool:
        return self._done < self._wanted

    def request_resync(self) -> None:
        with self._lock:
            self._wanted += 1

    # ---- KVEventListener (engine thread) -------------------------------------------------
    def stored(self, hashes: list[int], positions: list[int], medium: str = DEVICE) -> None:
        keep = [h for h, p in zip(hashes, positions, strict=True) if p < self.config.depth]
        if keep:
            self._push("+", keep, medium)

    def removed(self, hashes: list[int], medium: str = DEVICE) -> None:
        self._push("-", hashes, medium)

    def cleared(self) -> None:
        with self._lock:
            self._events.clear()
            self._backlog = 0
            self._wanted += 1

    def _push(self, op: str, hashes: list[int], medium: str) -> None:
        with self._lock:
            if self._backlog >= self.config.max_backlog:
                self.stats.dropped += len(hashes)
                self._wanted += 1
                return
            self._events.append((op, hashes, medium))
            self._backlog += len(hashes)

    def reset_events(self) -> None:
        """Called with the engine paused, right after taking a snapshot."""
        with self._lock:
            self._events.clear()
            self._backlog = 0

    def load_changed(self) -> None:
        """A request arrived or finished: beat at the next flush (event loop thread)."""
        self._load_changed = True

    # ---- background task -----------------------------------------------------------------
    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, unregister: bool = True) -> None:
        self._stopping = True  # the loop checks it too: Python 3.11's wait_for can swallow a cancel
        if self._task is not None:
            self._task.cancel()
            # bounded: a Redis call stuck in a socket must not hang the replica's shutdown
            await asyncio.wait({self._task}, timeout=self.config.timeout_s * 4)
        if unregister and self._client is not None:
            try:  # retract our entries now rather than waiting for garbage collection
                writer = IndexWriter(self._client, self.keys)
                await asyncio.wait_for(writer.retract(self.config.replica_id), self.config.timeout_s * 4)
            except Exception:  # Redis away: the heartbeat TTL and GC clean up instead
                pass
        if self._client is not None:
            try:
                await asyncio.wait_for(self._client.aclose(), self.config.timeout_s * 2)
            except Exception:
                pass

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_beat = next_gc = last_beat = 0.0
        bound = self.config.timeout_s * 4  # no Redis call may hang the loop (e.g. a stuck TLS handshake)
        writer: IndexWriter | None = None
        while not self._stopping:
            try:
                if writer is None:
                    self._client = await asyncio.wait_for(open_client(self.config.redis_url, self.config.timeout_s), bound)
                    writer = IndexWriter(self._client, self.keys)
                if self.resync_due:
                    await self._full_resync(writer, bound)
                await asyncio.wait_for(self._flush(writer), bound)
                now = loop.time()
                changed = self._load_changed and now >= last_beat + self.config.beat_on_change_s
                if now >= next_beat or changed:
                    self._load_changed = False
                    await asyncio.wait_for(self._heartbeat(writer), bound)
                    last_beat, next_beat = now, now + self.config.heartbeat_s
                if now >= next_gc:
                    gc_ms = int(self.config.gc_s * 1000)
                    dead = await asyncio.wait_for(writer.collect_garbage(self._holder, gc_ms), bound * 4)
                    if dead:
                        self.stats.collected += len(dead)
                        log.info("garbage-collected dead replicas %s", dead)
                    next_gc = now + self.config.gc_s
                self.stats.connected = True
                await asyncio.sleep(self.config.flush_s)
                self.rounds += 1
            except (Exception, asyncio.CancelledError) as e:  # never let publishing die
                task = asyncio.current_task()
                if self._stopping or task is None or task.cancelling():
                    return  # stopped or cancelled, even if the cancel came back as another error
                # here a CancelledError raised inside a Redis call, with no cancel pending, is a failure
                self.stats.errors += 1
                if self.stats.connected:
                    log.warning("redis unavailable (%r); will resync when it is back", e)
                self.stats.connected = False
                with self._lock:  # events are stale once a resync is due
                    self._wanted += 1
                    self.stats.dropped += self._backlog
                    self._events.clear()
                    self._backlog = 0
                await asyncio.sleep(min(1.0, self.config.heartbeat_s * 2))

    async def _full_resync(self, writer: IndexWriter, bound: float) -> None:
        generation = self._wanted
        snapshot = self._snapshot()  # also clears queued events, atomically with the engine
        if inspect.isawaitable(snapshot):  # the replica takes it between engine steps
            snapshot = await snapshot
        blocks = [(h, m) for h, p, m in snapshot if p < self.config.depth]
        await asyncio.wait_for(self._heartbeat(writer), bound)  # alive before (re)registering
        # a big cache takes longer than one call's bound: allow for its size
        await asyncio.wait_for(writer.replace(self.config.replica_id, blocks), bound + len(blocks) / 20_000)
        self._done = max(self._done, generation)
        self.stats.resyncs += 1
        self.stats.published += len(blocks)

    async def _flush(self, writer: IndexWriter) -> None:
        with self._lock:
            batch = list(self._events)
            self._events.clear()
            self._backlog = 0
        if not batch:
            return
        await writer.apply(self.config.replica_id, batch)
        self.stats.published += sum(len(h) for _, h, _ in batch)

    async def _heartbeat(self, writer: IndexWriter) -> None:
        load = self._load()
        mapping = load.to_redis() if isinstance(load, Heartbeat) else load
        lost = await writer.heartbeat(self.config.replica_id, mapping, int(self.config.heartbeat_ttl_s * 1000))
        self.beats += 1
        if lost and not self.resync_due:
            # The heartbeat was gone: Redis restarted, or we were silent long enough for
            # garbage collection to drop our blocks. Either way, publish everything again.
            self.request_resync()


__all__ = ["BlockPublisher", "PublisherConfig", "PublisherStats"]
