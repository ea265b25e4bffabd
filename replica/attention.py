"""Paged attention plugged into transformers' model definitions.

The model runs on one flattened sequence of tokens from many requests (no padding in the
matmuls). transformers calls our attention function per layer; it writes the new K/V into
the shared pool at `slot_mapping`, then attends each request's queries over that request's
K/V gathered from the pool through its block table. Cached prefix blocks are read in place.

Registered as the attention implementation "prefixgate_paged" (plus a mask function that
builds nothing: masks come from the metadata below), so any transformers model that uses
the attention interface (Llama, Qwen2, Qwen3, Mistral, ...) runs unmodified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

PAGED_ATTENTION = "prefixgate_paged"


@dataclass
class KVPool:
    """K and V for every layer: [num_layers, num_blocks * block_size, kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, layers: int, slots: int, kv_heads: int, head_dim: int, dtype, device) -> KVPool:
        shape = (layers, slots, kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))


@dataclass
class PrefillSegment:
    """Queries rows [q_start, q_end) of one request attending over kv_slots (its whole context)."""

    q_start: int
    q_end: int
    kv_slots: torch.Tensor | None  # None: no cached prefix, attend over the new K/V directly
    mask: torch.Tensor | None  # [q, kv] bool, None when plain causal


@dataclass
class AttentionMetadata:
    pool: KVPool
    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    prefills: list[PrefillSegment] = field(default_factory=list)
    block_size: int = 16
    num_decodes: int = 0  # the first num_decodes rows are single-token decodes
    decode_block_tables: torch.Tensor | None = None  # [B, M] block ids of each decode's context
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, M * block_size] True where a slot is valid


_metadata: AttentionMetadata | None = None


def set_metadata(meta: AttentionMetadata | None) -> None:
    global _metadata
    _metadata = meta


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, KVH, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta = _metadata
    if meta is None:
        raise RuntimeError("paged attention called outside the engine's forward pass")
    k_pool, v_pool = meta.pool.k[module.layer_idx], meta.pool.v[module.layer_idx]
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KVH, D]
    k_pool.index_copy_(0, meta.slot_mapping, k_new)
    v_pool.index_copy_(0, meta.slot_mapping, v_new)

    q = query[0]  # [H, T, D]
    out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, H, D]
    for seg in meta.prefills:
        qs = q[:, seg.q_start : seg.q_end].unsqueeze(0)
        if seg.kv_slots is None:
            ks = key[:, :, seg.q_start : seg.q_end]
            vs = value[:, :, seg.q_start : seg.q_end]
        else:
            ks = k_pool.index_select(0, seg.kv_slots).transpose(0, 1).unsqueeze(0)
            vs = v_pool.index_select(0, seg.kv_slots).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scaling, enable_gqa=True
        )
        out[seg.q_start : seg.q_end] = o[0].transpose(0, 1)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode_attention(q[:, : meta.num_decodes], k_pool, v_pool, meta, scaling)
    return out.unsqueeze(0), None


def _decode_attention(q: torch.Tensor, k_pool, v_pool, meta: AttentionMetadata, scaling: float | None) -> torch.Tensor:
    """One query token per sequence over its paged context, for the whole batch at once.

    Whole blocks are gathered (a few large copies rather than one per token), and grouped-query
    heads are handled by reshaping the queries to [kv_heads, group] instead of expanding K/V.
    q: [H, B, D] -> returns [B, H, D].
    """
    h, b, d = q.shape
    kv_heads = k_pool.shape[1]
    tables = meta.decode_block_tables.view(-1)
    blocks_k = k_pool.view(-1, meta.block_size, kv_heads, d).index_select(0, tables)
    blocks_v = v_pool.view(-1, meta.block_size, kv_heads, d).index_select(0, tables)
    keys = blocks_k.view(b, -1, kv_heads, d).permute(0, 2, 3, 1)  # [B, KVH, D, L]
    values = blocks_v.view(b, -1, kv_heads, d).transpose(1, 2)  # [B, KVH, L, D]
    queries = q.transpose(0, 1).reshape(b, kv_heads, h // kv_heads, d)  # [B, KVH, G, D]
    scores = torch.matmul(queries, keys).float() * (scaling if scaling is not None else d**-0.5)
    scores.masked_fill_(~meta.decode_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).reshape(b, h, d)


def _no_mask(*args, **kwargs) -> None:
    return None


def register() -> None:
    """Make "prefixgate_paged" a valid `attn_implementation` for transformers models."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    AttentionMaskInterface.register(PAGED_ATTENTION, _no_mask)
