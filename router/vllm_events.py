"""Feeds our shared index from a vLLM replica's KV-event stream (ZMQ PUB, see
router.protocol.events): a vLLM fleet becomes routable by PrefixGateRouter without changes
to vLLM.

vLLM's block hashes are seeded per process, so they are not ours and may differ between two
vLLM replicas holding the same prefix. The adapter re-hashes every stored block from the
event's token ids with our spec, chaining from the parent's re-hashed value (kept in a map
vLLM hash -> ours), and publishes our hashes for the replica the stream belongs to. Removals
and clears go through the same map. A heartbeat without load fields keeps the replica alive
for garbage collection while its load stays *unknown* to routers (vLLM's events carry none).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from router.index_writer import IndexWriter
from router.protocol.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    seq_from_bytes,
)
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.redis_schema import DEFAULT_KEY_PREFIX, INDEX_BUCKETS, RedisKeys
from router.redis_index import Client, open_client
from router.router_options import PUBLISH_DEPTH

log = logging.getLogger("prefixgate.vllm_events")


@dataclass
class AdapterConfig:
    endpoint: str  # the vLLM replica's KV-events PUB socket, e.g. tcp://127.0.0.1:5557
    replica_id: str  # the id routers know this replica by
    redis_url: str
    model_id: str  # our hash spec's seed: must match the router's model_id
    key_prefix: str = DEFAULT_KEY_PREFIX
    block_size: int = 16  # must match vLLM's block size and the router's
    depth: int = PUBLISH_DEPTH  # leading blocks of a prompt published (as our publisher does)
    cache_salt: str | None = None
    topic: bytes = b""
    buckets: int = INDEX_BUCKETS
    heartbeat_s: float = 0.5
    heartbeat_ttl_s: float = 3.0
    timeout_s: float = 0.5


@dataclass
class AdapterStats:
    batches: int = 0
    stored: int = 0
    removed: int = 0
    clears: int = 0
    skipped: int = 0  # stored blocks whose parent was unknown, or of a foreign block size
    gaps: int = 0  # sequence numbers missed (a resync from vLLM's replay socket would fill them)
    bad_messages: int = 0
    last_seq: int = -1
    extra: dict = field(default_factory=dict)


class EventTranslator:
    """vLLM events -> our ("+"/"-", hashes) writes; pure (no I/O), so it is tested alone too."""

    def __init__(self, model_id: str, block_size: int, depth: int, cache_salt: str | None = None) -> None:
        self.model_id = model_id
        self.block_size = block_size
        self.depth = depth
        self.cache_salt = cache_salt  # the salt of prompts whose events carry none
        self.seed = chain_seed(model_id, cache_salt)
        self._seeds: dict[str | None, int] = {cache_salt: self.seed}
        self._ours: dict[BlockHash, tuple[int, int]] = {}  # vLLM hash -> (our hash, block position)
        self._held: set[int] = set()  # our hashes of what vLLM holds
        self.stats = AdapterStats()

    def leading_held(self, hashes: list[int]) -> int:
        """How many of a prompt's leading blocks (our hashes) vLLM holds now."""
        n = 0
        for h in hashes:
            if h not in self._held:
                break
            n += 1
        return n

    def held(self) -> list[tuple[int, int]]:
        """(our hash, position) of every block vLLM holds now, as far as its events told: what a
        publisher's full resync writes."""
        return [(h, pos) for h, pos in self._ours.values() if pos < self.depth]

    def chain_root(self, salt: str | None) -> int:
        if salt is None:
            return self.seed
        if salt not in self._seeds:
            self._seeds[salt] = chain_seed(self.model_id, salt)
        return self._seeds[salt]

    def translate(self, batch: KVEventBatch) -> list[tuple[str, list[int]]]:
        """Writes for one batch, in order; ("clear", []) for AllBlocksCleared."""
        return [(op, [h for h, _ in blocks]) for op, blocks in self._writes(batch)]

    def feed(self, batch: KVEventBatch, listeners: list) -> None:
        """One batch into KVEventListeners (replica/block_manager.py), e.g. a replica's own
        BlockPublisher: the vLLM backend publishes through the same path as our engine."""
        for op, blocks in self._writes(batch):
            for listener in listeners:
                if op == "+":
                    listener.stored([h for h, _ in blocks], [p for _, p in blocks])
                elif op == "-":
                    listener.removed([h for h, _ in blocks])
                else:
                    listener.cleared()

    def _writes(self, batch: KVEventBatch) -> list[tuple[str, list[tuple[int, int]]]]:
        out: list[tuple[str, list[tuple[int, int]]]] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                ours = self._stored(event)
                if ours:
                    out.append(("+", ours))
            elif isinstance(event, BlockRemoved):
                ours = [self._ours.pop(h) for h in event.block_hashes if h in self._ours]
                self._held.difference_update(h for h, _ in ours)
                self.stats.removed += len(ours)
                if ours:
                    out.append(("-", ours))
            elif isinstance(event, AllBlocksCleared):
                self._ours.clear()
                self._held.clear()
                self.stats.clears += 1
                out.append(("clear", []))
        return out

    @property
    def num_held(self) -> int:
        """Blocks vLLM's prefix cache holds, as its events told."""
        return len(self._ours)

    def _stored(self, event: BlockStored) -> list[tuple[int, int]]:
        n = len(event.block_hashes)
        if event.block_size != self.block_size or len(event.token_ids) < n * self.block_size:
            self.stats.skipped += n
            return []
        if event.parent_block_hash is None:  # a tenant's prompt starts from its own salted root
            parent, position = self.chain_root(event.cache_salt()), 0
        elif event.parent_block_hash in self._ours:
            parent, parent_pos = self._ours[event.parent_block_hash]
            position = parent_pos + 1
        else:  # we never saw the parent (joined mid-stream): its chain cannot be rebuilt
            self.stats.skipped += n
            return []
        # the event carries only the new blocks' tokens: chain them from the parent's hash
        ours = block_hashes(event.token_ids[: n * self.block_size], self.block_size, self.seed, 0, parent)
        published = []
        for i, (theirs, mine) in enumerate(zip(event.block_hashes, ours, strict=True)):
            self._ours[theirs] = (mine, position + i)
            self._held.add(mine)
            if position + i < self.depth:
                published.append((mine, position + i))
        self.stats.stored += len(published)
        return published


class VllmEventAdapter:
    """Subscribes to one vLLM replica's events and keeps its entries in our index."""

    def __init__(self, config: AdapterConfig) -> None:
        self.config = config
        self.keys = RedisKeys(config.key_prefix, config.buckets)
        self.translator = EventTranslator(config.model_id, config.block_size, config.depth, config.cache_salt)
        self.stats = self.translator.stats
        self._client: Client | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, unregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=2.0)
        if self._client is not None:
            if unregister:
                try:
                    await asyncio.wait_for(IndexWriter(self._client, self.keys).retract(self.config.replica_id), 2.0)
                except Exception:
                    pass
            try:
                await asyncio.wait_for(self._client.aclose(), 1.0)
            except Exception:
                pass

    async def _run(self) -> None:
        cfg = self.config
        self._client = await open_client(cfg.redis_url, cfg.timeout_s)
        writer = IndexWriter(self._client, self.keys)
        # forget an earlier incarnation's entries; the heartbeat task registers the replica
        await writer.replace(cfg.replica_id, [], register=False)
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, cfg.topic)
        sock.connect(cfg.endpoint)
        beat = asyncio.get_running_loop().create_task(self._beat(writer))
        try:
            while True:
                try:
                    parts = await asyncio.wait_for(sock.recv_multipart(), cfg.heartbeat_s)
                except TimeoutError:
                    continue
                await self._handle(writer, parts)
        finally:
            beat.cancel()
            sock.close()

    async def _handle(self, writer: IndexWriter, parts: list[bytes]) -> None:
        if len(parts) != 3:
            self.stats.bad_messages += 1
            return
        _, seq_raw, payload = parts
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.stats.bad_messages += 1
            return
        seq = seq_from_bytes(seq_raw)
        if self.stats.last_seq >= 0 and seq > self.stats.last_seq + 1:
            self.stats.gaps += seq - self.stats.last_seq - 1
        self.stats.last_seq = seq
        self.stats.batches += 1
        writes = self.translator.translate(batch)
        rid = self.config.replica_id
        pending: list[tuple[str, list[int]]] = []
        for op, hashes in writes:
            if op == "clear":
                if pending:
                    await writer.apply(rid, pending)
                    pending = []
                await writer.replace(rid, [])
            else:
                pending.append((op, hashes))
        if pending:
            await writer.apply(rid, pending)

    async def _beat(self, writer: IndexWriter) -> None:
        """Liveness only: a hash without load fields reads as unknown load to routers."""
        ttl_ms = int(self.config.heartbeat_ttl_s * 1000)
        while True:
            try:
                await writer.heartbeat(self.config.replica_id, {"source": "vllm-kv-events"}, ttl_ms)
            except Exception as e:  # Redis away: routers see the replica's load as unknown
                log.debug("heartbeat failed: %r", e)
            await asyncio.sleep(self.config.heartbeat_s)
