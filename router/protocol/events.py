"""Block events in the shape of vLLM's KV-cache events (vllm.distributed.kv_events), so that an
index fed by our replicas and one fed by vLLM replicas speak the same language.

Wire format, as vLLM's ZmqEventPublisher sends it: a ZMQ multipart message
(topic, sequence number as 8 bytes big-endian, payload); the payload is a msgpack array
[ts, [event, ...], data_parallel_rank?]. Each event is, depending on vLLM's version, either an
array whose first element is its type's name (["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name, extra_keys, ...], ["BlockRemoved",
block_hashes, medium], ["AllBlocksCleared"]) or a map tagged by "type" with the same field names
(vLLM 0.32, measured). `decode_batch` accepts both and ignores fields added later.

A vLLM block hash is an int or bytes, seeded per process unless PYTHONHASHSEED is pinned:
consumers re-hash from token_ids with our spec (router.protocol.hashing) instead of trusting it.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

BlockHash = int | bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three event types; the tag (the class name) leads the encoded array."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # per block, what vLLM mixed into its hash besides the tokens: the LoRA name, multimodal
    # ids, and the request's cache_salt (a string, on the first block of a salted prompt)
    extra_keys: list[list[Any] | None] | None = None

    def cache_salt(self) -> str | None:
        """The tenant salt vLLM hashed into the first block, when this run starts a prompt."""
        if self.parent_block_hash is not None or not self.extra_keys or not self.extra_keys[0]:
            return None
        salts = [k for k in self.extra_keys[0] if isinstance(k, str)]
        if self.lora_name is not None and salts and salts[0] == self.lora_name:
            salts = salts[1:]  # the LoRA name leads the keys when set
        return salts[0] if salts else None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The map-shaped events of vLLM 0.32: same names and fields, tagged by a "type" key.
class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag_field="type"):
    pass


class _MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _MapBatch(EventBatch):
    events: list[_MapBlockStored | _MapBlockRemoved | _MapAllBlocksCleared]


_AS_ARRAY = {_MapBlockStored: BlockStored, _MapBlockRemoved: BlockRemoved, _MapAllBlocksCleared: AllBlocksCleared}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_map_decoder = msgspec.msgpack.Decoder(_MapBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Either wire shape -> KVEventBatch. Raises msgspec.DecodeError / ValidationError on
    anything that is not a KV event batch."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError:
        batch = _map_decoder.decode(payload)  # raises the same errors when neither shape fits
    events = [_AS_ARRAY[type(e)](**msgspec.structs.asdict(e)) for e in batch.events]
    return KVEventBatch(batch.ts, events, batch.data_parallel_rank)


def seq_from_bytes(data: bytes) -> int:
    return int.from_bytes(data, "big", signed=True)


class KVEventListener(Protocol):
    """Where a replica's cache membership changes go, in our hashes (the replica's BlockPublisher
    writes them to Redis): our engine's block manager calls it, and so does the translator of a
    vLLM replica's events (router/vllm_events.py)."""

    def stored(self, hashes: list[int], positions: list[int], medium: str = "device") -> None:
        """Blocks became cached in `medium`; positions[i] is the block index of hashes[i] in its prompt."""

    def removed(self, hashes: list[int], medium: str = "device") -> None:
        """Cached blocks left `medium` (evicted, or moved to another medium)."""

    def cleared(self) -> None:
        """Every cached block was dropped."""
