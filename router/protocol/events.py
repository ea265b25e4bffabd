"""Block events in the shape of vLLM's KV-cache events (vllm.distributed.kv_events), so that an
index fed by our replicas and one fed by vLLM replicas speak the same language.

Wire format, as vLLM's ZmqEventPublisher sends it: a ZMQ multipart message
(topic, sequence number as 8 bytes big-endian, payload); the payload is a msgpack array
[ts, [event, ...], data_parallel_rank?] and each event an array whose first element is its
type's name: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"].

A vLLM block hash is an int or bytes, seeded per process unless PYTHONHASHSEED is pinned:
consumers re-hash from token_ids with our spec (router.protocol.hashing) instead of trusting it.
"""

from __future__ import annotations

from typing import Any

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


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError / ValidationError on anything that is not a KV event batch."""
    return _decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_from_bytes(data: bytes) -> int:
    return int.from_bytes(data, "big", signed=True)
