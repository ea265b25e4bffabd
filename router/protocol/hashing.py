"""Chained block hashes: the one function shared by the engine (cache keys) and the router
(lookups in Redis). The spec and golden vectors live in docs/block-hashing.md.

h_seed = xxh64(b"prefixgate/v1\\0" + model_id + b"\\0" + cache_salt [+ b"\\0lora\\0" + adapter])
h_i    = xxh64(h_{i-1} as 8 bytes little-endian + token ids of block i as uint32 little-endian)

Chaining makes a block's key stand for the whole prefix up to it, because the K/V of a
position depends on every token before it. Only full blocks are hashed.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

HASH_DOMAIN = b"prefixgate/v1\x00"
# Tokens per hashed block where a deployment sets none: engines, routers and the index must
# agree on it (vLLM replicas need a multiple of 32: replica/backends/vllm_settings.py).
BLOCK_SIZE = 16


def chain_seed(model_id: str, cache_salt: str | None = None, adapter: str | None = None) -> int:
    """Root of every chain: equal only for the same model, tenant salt and LoRA adapter.

    `adapter` is the adapter's identity (router.protocol.lora.AdapterRef.identity: its name and
    content digest): the same tokens under two adapters are two different K/V. The base model's
    seed (adapter None) is unchanged by the field's existence."""
    data = HASH_DOMAIN + model_id.encode() + b"\x00" + (cache_salt or "").encode()
    if adapter:
        data += b"\x00lora\x00" + adapter.encode()
    return xxhash.xxh64_intdigest(data)


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """Key of one block given the key of the block before it (or the chain seed)."""
    payload = parent.to_bytes(8, "little") + struct.pack(f"<{len(token_ids)}I", *token_ids)
    return xxhash.xxh64_intdigest(payload)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed: int,
    start: int = 0,
    parent: int | None = None,
) -> list[int]:
    """Hashes of the full blocks of `token_ids`, beginning at block index `start`.

    `parent` is the hash of block `start - 1` (or the seed when start == 0); passing it lets
    callers extend a chain incrementally without rehashing the whole prefix.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    h = seed if parent is None else parent
    end = len(token_ids) // block_size
    if end <= start:
        return []
    # pack once, slice per block: the same bytes as hash_block, a few times faster
    data = struct.pack(f"<{(end - start) * block_size}I", *token_ids[start * block_size : end * block_size])
    width = 4 * block_size
    out: list[int] = []
    for i in range(end - start):
        h = xxhash.xxh64_intdigest(h.to_bytes(8, "little") + data[i * width : (i + 1) * width])
        out.append(h)
    return out
