"""Translates a vLLM engine's KV-event stream (ZMQ PUB, see router.protocol.events) into our
block events: a vLLM replica (replica/backends/vllm_backend.py) publishes through the same
BlockPublisher as our engine, so PrefixGateRouter routes vLLM replicas without changes to vLLM.

vLLM's block hashes are seeded per process, so they are not ours and may differ between two
vLLM replicas holding the same prefix. The translator re-hashes every stored block from the
event's token ids with our spec, chaining from the parent's re-hashed value (kept in a map
vLLM hash -> ours), and hands our hashes to its listeners. Removals and clears go through the
same map. `pump_events` is the receiving loop: one ZMQ message at a time, counted gaps and bad
messages included.

Each event names its medium ("GPU", or "CPU" for vLLM's offloading connector: the same vLLM
hash, with no tokens). vLLM may hold a block on the GPU and a CPU copy of it at once, while our
index lists a replica once per block (router/protocol/media.py): the adapter tracks every
medium vLLM holds a block in and reports the fastest, so a GPU eviction of a block with a
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

from router.index.index_writer import Event
from router.protocol.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventListener,
    decode_batch,
    seq_from_bytes,
)
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.media import DEVICE, MEDIA, UnknownMedium, parse_medium

log = logging.getLogger("prefixgate.vllm_events")


@dataclass
class TranslatorStats:
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
        self.stats = TranslatorStats()

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

    def feed(self, batch: KVEventBatch, listeners: list[KVEventListener]) -> None:
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


async def pump_events(sock: zmq.asyncio.Socket, translator: EventTranslator, listeners: list[KVEventListener]) -> None:
    """vLLM's KV events from `sock` (a SUB socket connected to its publisher) -> our hashes ->
    `listeners` (a replica's BlockPublisher), until the socket closes or the task is cancelled.
    A message of the wrong shape or a payload that does not decode is counted, never fatal;
    a jump in vLLM's sequence numbers is counted as gaps (events the index missed until the
    next resync)."""
    stats = translator.stats
    while True:
        try:
            parts = await sock.recv_multipart()
        except (asyncio.CancelledError, zmq.ZMQError):
            return
        if len(parts) != 3:
            stats.bad_messages += 1
            continue
        try:
            batch = decode_batch(parts[2])
            seq = seq_from_bytes(parts[1])
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            stats.bad_messages += 1
            continue
        if stats.last_seq >= 0 and seq > stats.last_seq + 1:
            stats.gaps += seq - stats.last_seq - 1
        stats.last_seq = seq
        stats.batches += 1
        translator.feed(batch, listeners)
