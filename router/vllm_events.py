"""Feeds our shared index from a vLLM replica's KV-event stream (ZMQ PUB, see
router.protocol.events): a vLLM fleet becomes routable by PrefixGateRouter without changes
to vLLM.

vLLM's block hashes are seeded per process, so they are not ours and may differ between two
vLLM replicas holding the same prefix. The adapter re-hashes every stored block from the
event's token ids with our spec, chaining from the parent's re-hashed value (kept in a map
vLLM hash -> ours), and publishes our hashes for the replica the stream belongs to. Removals
and clears go through the same map. A heartbeat without load fields keeps the replica alive
for garbage collection while its load stays *unknown* to routers (vLLM's events carry none).

Each event names its medium ("GPU", or "CPU" for vLLM's offloading connector: the same vLLM
hash, with no tokens). vLLM may hold a block on the GPU and a CPU copy of it at once, while our
index lists a replica once per block (router/protocol/media.py): the adapter tracks every
medium vLLM holds a block in and publishes the fastest, so a GPU eviction of a block with a
CPU copy becomes a move to the host tier (removed from the pool, stored in the host tier).
An event in a medium we do not know is counted and skipped.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from router.index.index_writer import Event, IndexWriter
from router.index.redis_index import Client, open_client
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
from router.protocol.media import DEVICE, MEDIA, UnknownMedium, parse_medium
from router.protocol.redis_schema import DEFAULT_KEY_PREFIX, INDEX_BUCKETS, RedisKeys
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
    stored: int = 0  # blocks published as stored (a move to the host tier included)
    removed: int = 0  # blocks vLLM removed from one of its media
    clears: int = 0
    skipped: int = 0  # stored blocks whose parent was unknown, or of a foreign block size
    unknown_media: int = 0  # events skipped for a medium we have no tier for
    gaps: int = 0  # sequence numbers missed (a resync from vLLM's replay socket would fill them)
    bad_messages: int = 0
    last_seq: int = -1
    extra: dict = field(default_factory=dict)


# (op, [(our hash, position)], medium): "+" stored, "-" removed, "clear" (no blocks)
_Write = tuple[str, list[tuple[int, int]], str]


@dataclass(slots=True)
class _Block:
    """One block vLLM holds, under our hash, and every medium it holds it in."""

    ours: int
    position: int
    media: set[str] = field(default_factory=set)

    @property
    def medium(self) -> str | None:
        """Where the index lists it: the fastest medium holding it (None: nowhere)."""
        return next((m for m in MEDIA if m in self.media), None)


class EventTranslator:
    """vLLM events -> our ("+"/"-", hashes, medium) writes; pure (no I/O), so it is tested alone
    too."""

    def __init__(self, model_id: str, block_size: int, depth: int, cache_salt: str | None = None) -> None:
        self.model_id = model_id
        self.block_size = block_size
        self.depth = depth
        self.cache_salt = cache_salt  # the salt of prompts whose events carry none
        self.seed = chain_seed(model_id, cache_salt)
        self._seeds: dict[tuple[str | None, str | None], int] = {(cache_salt, None): self.seed}
        self._blocks: dict[BlockHash, _Block] = {}  # vLLM hash -> ours, position, media
        self._held: set[int] = set()  # our hashes of what vLLM holds, in any medium
        self._unknown_seen: set[str | None] = set()  # unknown media already logged
        self.stats = AdapterStats()

    def leading_held(self, hashes: list[int]) -> int:
        """How many of a prompt's leading blocks (our hashes) vLLM holds now, in any medium
        (a CPU copy is loaded, not computed)."""
        n = 0
        for h in hashes:
            if h not in self._held:
                break
            n += 1
        return n

    def held(self) -> list[tuple[int, int, str]]:
        """(our hash, position, medium) of every block vLLM holds now, as far as its events told:
        what a publisher's full resync writes."""
        return [(b.ours, b.position, b.medium) for b in self._blocks.values() if b.position < self.depth]

    def chain_root(self, salt: str | None, adapter: str | None = None) -> int:
        """Our root of a prompt's chain: the model's, under the tenant's salt (None: the stream's
        own) and the LoRA adapter's identity (None: the base model). vLLM's events name the
        adapter by the `lora_name` it was registered under, which a prefixgate replica makes the
        adapter's identity (router.protocol.lora.AdapterRef.identity: name and content digest)."""
        salt = self.cache_salt if salt is None else salt
        key = (salt, adapter or None)
        root = self._seeds.get(key)
        if root is None:
            root = self._seeds[key] = chain_seed(self.model_id, salt, adapter)
        return root

    def translate(self, batch: KVEventBatch) -> list[Event]:
        """Writes for one batch, in order; ("clear", [], DEVICE) for AllBlocksCleared."""
        return [(op, [h for h, _ in blocks], medium) for op, blocks, medium in self._writes(batch)]

    def feed(self, batch: KVEventBatch, listeners: list) -> None:
        """One batch into KVEventListeners (replica/kvcache/block_manager.py), e.g. a replica's own
        BlockPublisher: the vLLM backend publishes through the same path as our engine."""
        for op, blocks, medium in self._writes(batch):
            for listener in listeners:
                if op == "+":
                    listener.stored([h for h, _ in blocks], [p for _, p in blocks], medium=medium)
                elif op == "-":
                    listener.removed([h for h, _ in blocks], medium=medium)
                else:
                    listener.cleared()

    def _writes(self, batch: KVEventBatch) -> list[_Write]:
        out: list[_Write] = []
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self._blocks.clear()
                self._held.clear()
                self.stats.clears += 1
                out.append(("clear", [], DEVICE))
                continue
            medium = self._medium(event.medium)
            if medium is None:
                continue
            if isinstance(event, BlockStored):
                if any(h not in self._blocks for h in event.block_hashes):
                    self._register(event)
                out += self._move(event.block_hashes, medium, stored=True)
            elif isinstance(event, BlockRemoved):
                out += self._move(event.block_hashes, medium, stored=False)
        return out

    def _medium(self, raw: str | None) -> str | None:
        """Our medium for an event's, or None (counted, logged once per name) if we have none."""
        try:
            return parse_medium(raw)
        except UnknownMedium as e:
            self.stats.unknown_media += 1
            if raw not in self._unknown_seen:
                self._unknown_seen.add(raw)
                log.warning("skipping KV events: %s", e)
            return None

    @property
    def num_held(self) -> int:
        """Blocks vLLM's prefix cache holds (in any medium), as its events told."""
        return len(self._blocks)

    def _register(self, event: BlockStored) -> None:
        """Our hashes for the event's blocks we do not know yet, re-hashed from its tokens."""
        n = len(event.block_hashes)
        unknown = sum(h not in self._blocks for h in event.block_hashes)
        if event.block_size != self.block_size or len(event.token_ids) < n * self.block_size:
            self.stats.skipped += unknown  # e.g. a CPU copy of a block we never saw stored
            return
        if event.parent_block_hash is None:  # a prompt starts from its tenant's and its adapter's root
            parent, position = self.chain_root(event.cache_salt(), event.lora_name), 0
        elif event.parent_block_hash in self._blocks:
            parent_block = self._blocks[event.parent_block_hash]
            parent, position = parent_block.ours, parent_block.position + 1
        else:  # we never saw the parent (joined mid-stream): its chain cannot be rebuilt
            self.stats.skipped += unknown
            return
        # the event carries only the new blocks' tokens: chain them from the parent's hash
        ours = block_hashes(event.token_ids[: n * self.block_size], self.block_size, self.seed, 0, parent)
        for i, (theirs, mine) in enumerate(zip(event.block_hashes, ours, strict=True)):
            self._blocks.setdefault(theirs, _Block(mine, position + i))

    def _move(self, hashes: list[BlockHash], medium: str, stored: bool) -> list[_Write]:
        """The blocks enter (`stored`) or leave `medium`; writes for those whose fastest medium
        changed: removals from the old one first, then stores in the new one."""
        removed: dict[str, list[tuple[int, int]]] = {}
        added: dict[str, list[tuple[int, int]]] = {}
        for h in hashes:
            block = self._blocks.get(h)
            if block is None or (not stored and medium not in block.media):
                continue
            before = block.medium
            if stored:
                block.media.add(medium)
            else:
                block.media.discard(medium)
                self.stats.removed += 1
            after = block.medium
            if after is None:
                del self._blocks[h]
                self._held.discard(block.ours)
            else:
                self._held.add(block.ours)
            if before == after or block.position >= self.depth:
                continue
            if before is not None:
                removed.setdefault(before, []).append((block.ours, block.position))
            if after is not None:
                added.setdefault(after, []).append((block.ours, block.position))
                self.stats.stored += 1
        return [("-", b, m) for m, b in removed.items()] + [("+", b, m) for m, b in added.items()]


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
        pending: list[Event] = []
        for op, hashes, medium in writes:
            if op == "clear":
                if pending:
                    await writer.apply(rid, pending)
                    pending = []
                await writer.replace(rid, [])
            else:
                pending.append((op, hashes, medium))
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
