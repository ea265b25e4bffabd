"""Paged attention plugged into transformers' model definitions.

The model runs on one flattened sequence of tokens from many requests (no padding in the
matmuls). transformers calls our attention function per layer; it writes the new K/V into
the shared pool at `slot_mapping`, then attends each request's queries over that request's
K/V gathered from the pool through its block table. Cached prefix blocks are read in place.

Decode rows are grouped by context length (see DecodeGroup) so the K/V read per layer follows
the real tokens, and blocks that several decodes' contexts start with (a shared system prompt
hit in the prefix cache) are read once for all of them (cascade attention, see DecodeCascade);
decode softmax runs in float32 also for bf16 pools. Models whose attention
needs what is not implemented here (soft-capping, sinks, a sliding window shorter than the
context) are refused at load time with UnsupportedModelError.

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
    """K and V for every layer: [num_layers, kv_heads, num_blocks * block_size, head_dim].

    Head-major, so a gather of whole blocks is already laid out [kv_heads, tokens, head_dim],
    the shape attention multiplies: no second copy to reorder it.
    """

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, layers: int, slots: int, kv_heads: int, head_dim: int, dtype, device) -> KVPool:
        shape = (layers, kv_heads, slots, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))


@dataclass
class PrefillSegment:
    """Queries rows [q_start, q_end) of one request attending over kv_slots (its whole context)."""

    q_start: int
    q_end: int
    kv_slots: torch.Tensor | None  # None: no cached prefix, attend over the new K/V directly
    mask: torch.Tensor | None  # [q, kv] bool, None when plain causal


@dataclass
class DecodeGroup:
    """Decode rows [start, end) whose contexts have similar lengths, padded to the longest.

    Decodes are sorted by context length and cut into groups whose padded size stays within
    twice their real tokens, so the K/V gathered per layer follows the tokens that exist (32
    short contexts next to 1 long one never pad the short ones to the long one's length).
    """

    start: int
    end: int
    block_tables: torch.Tensor  # [b, M] block ids of each row's context
    mask: torch.Tensor | None  # [1, b, 1, M * block_size] True where a slot is valid; None: all


@dataclass
class DecodeCascade:
    """Decode rows [start, end) whose contexts start with the same physical `prefix_blocks`.

    The prefix is attended once for all these rows (one matrix product per KV head) and merged
    with each row's own suffix by log-sum-exp, so a system prompt shared by many requests is
    read once per step instead of once per request. `prefix_blocks` None: no shared prefix.
    `groups` cover [start, end) with absolute row ranges, block tables past the prefix.
    """

    start: int
    end: int
    prefix_blocks: torch.Tensor | None
    groups: list[DecodeGroup] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    pool: KVPool
    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    prefills: list[PrefillSegment] = field(default_factory=list)
    block_size: int = 16
    num_decodes: int = 0  # the first num_decodes rows are single-token decodes
    decode_cascades: list[DecodeCascade] = field(default_factory=list)  # cover rows [0, num_decodes)
    max_context: int = 0  # longest context in the step (checked against a sliding window)


_metadata: AttentionMetadata | None = None
_backend = None  # None: the torch path below; else attends in its place (set_backend)


def set_metadata(meta: AttentionMetadata | None) -> None:
    global _metadata
    _metadata = meta


def set_backend(name: str) -> None:
    """Which attention runs: "torch" (default; CPU and CUDA) or "triton" (replica/triton_attention.py's
    kernels for a GPU, or its interpreter), given the same queries, pools and metadata."""
    global _backend
    if name not in ("torch", "triton"):
        raise ValueError(f"unknown attention backend {name!r}")
    if name == "triton":
        from replica import triton_attention

        _backend = triton_attention.forward
    else:
        _backend = None


class UnsupportedModelError(ValueError):
    """The model's attention needs something this engine does not implement."""


def unsupported_features(model, max_model_len: int) -> list[str]:
    """What in `model` our paged attention would silently get wrong (empty: it runs exactly).

    Checked at load time: logit soft-capping (Gemma 2), attention sinks (`s_aux`, gpt-oss), and
    a sliding window shorter than the context we serve (Mistral passes its window to every
    layer; Qwen2/3 and others only to layers typed "sliding_attention").
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    problems: list[str] = []
    if getattr(config, "attn_logit_softcapping", None) is not None:
        problems.append(f"attention logit soft-capping ({config.attn_logit_softcapping})")
    if any(hasattr(m, "sinks") for m in model.modules()):
        problems.append("attention sinks (s_aux)")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is not None and (layer_types is None or "sliding_attention" in layer_types) and window < max_model_len:
        problems.append(
            f"a sliding window of {window} tokens, shorter than the served context of {max_model_len}"
            f" (serve it with max_model_len <= {window})"
        )
    return problems


def check_supported(model, max_model_len: int) -> None:
    problems = unsupported_features(model, max_model_len)
    if problems:
        name = getattr(model.config, "model_type", type(model).__name__)
        raise UnsupportedModelError(f"model type {name!r} needs what this engine does not implement: {'; '.join(problems)}")


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
    _refuse_unimplemented(kwargs, meta)
    k_pool, v_pool = meta.pool.k[module.layer_idx], meta.pool.v[module.layer_idx]
    k_pool.index_copy_(1, meta.slot_mapping, key[0])  # key: [1, KVH, T, D]
    v_pool.index_copy_(1, meta.slot_mapping, value[0])

    q = query[0]  # [H, T, D]
    if _backend is not None:
        return _backend(q, k_pool, v_pool, meta, scaling).unsqueeze(0), None
    out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, H, D]
    for seg in meta.prefills:
        qs = q[:, seg.q_start : seg.q_end].unsqueeze(0)
        if seg.kv_slots is None:
            ks = key[:, :, seg.q_start : seg.q_end]
            vs = value[:, :, seg.q_start : seg.q_end]
        else:
            ks = k_pool.index_select(1, seg.kv_slots).unsqueeze(0)
            vs = v_pool.index_select(1, seg.kv_slots).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scaling, enable_gqa=True
        )
        out[seg.q_start : seg.q_end] = o[0].transpose(0, 1)
    if meta.num_decodes:
        _decode(q[:, : meta.num_decodes], k_pool, v_pool, meta, scaling, out)
    return out.unsqueeze(0), None


def _decode(q: torch.Tensor, k_pool, v_pool, meta: AttentionMetadata, scaling: float | None, out: torch.Tensor) -> None:
    """All decode rows: per cascade, the shared prefix once (if any), then each length group
    over its own blocks."""
    h, _, d = q.shape
    q = q.float() * (scaling if scaling is not None else d**-0.5)  # [H, B, D], scaled once
    for cascade in meta.decode_cascades:
        prefix = None
        if cascade.prefix_blocks is not None:
            rows = q[:, cascade.start : cascade.end]
            prefix = _prefix_attention(rows, k_pool, v_pool, cascade.prefix_blocks, meta.block_size)
        for group in cascade.groups:
            rows = q[:, group.start : group.end]
            if prefix is None:
                o = _decode_attention(rows, k_pool, v_pool, group, meta.block_size)
            else:
                o_s, lse_s = _decode_attention(rows, k_pool, v_pool, group, meta.block_size, with_lse=True)
                lo, hi = group.start - cascade.start, group.end - cascade.start
                o_p, lse_p = (t[:, lo:hi] for t in prefix)  # [KVH, b, G, (D)]
                lse = torch.logaddexp(lse_p, lse_s)
                o = o_p * (lse_p - lse).exp_().unsqueeze(-1) + o_s * (lse_s - lse).exp_().unsqueeze(-1)
            b = group.end - group.start
            out[group.start : group.end] = o.permute(1, 0, 2, 3).reshape(b, h, d).to(out.dtype)


def _prefix_attention(q: torch.Tensor, k_pool, v_pool, blocks: torch.Tensor, block_size: int):
    """Every decode row over the same prefix blocks: one matrix product per KV head, reading the
    prefix once instead of once per sequence. Returns (out, lse) as [KVH, B, G, D], [KVH, B, G]."""
    h, b, d = q.shape
    kv_heads = k_pool.shape[0]
    g = h // kv_heads
    keys = k_pool.view(kv_heads, -1, block_size, d).index_select(1, blocks).view(kv_heads, -1, d).float()
    values = v_pool.view(kv_heads, -1, block_size, d).index_select(1, blocks).view(kv_heads, -1, d).float()
    queries = q.reshape(kv_heads, g * b, d)  # rows ordered (g, b)
    o, lse = _softmax_attend(torch.matmul(queries, keys.transpose(-1, -2)), values)
    return o.view(kv_heads, g, b, d).transpose(1, 2), lse.view(kv_heads, g, b).transpose(1, 2)


def _softmax_attend(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scores) @ values and the log-sum-exp of the scores (to merge partial results)."""
    m = scores.amax(dim=-1, keepdim=True)
    e = scores.sub_(m).exp_()
    total = e.sum(dim=-1, keepdim=True)
    o = torch.matmul(e, values).div_(total)
    return o, (m + total.log()).squeeze(-1)


def _refuse_unimplemented(kwargs: dict, meta: AttentionMetadata) -> None:
    """Never run a model wrong: features checked at load time, checked again per call."""
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"paged attention does not implement {name}")
    window = kwargs.get("sliding_window")
    if window is not None and meta.max_context > window:
        raise UnsupportedModelError(f"context of {meta.max_context} tokens exceeds the sliding window of {window}")


def _decode_attention(q: torch.Tensor, k_pool, v_pool, group: DecodeGroup, block_size: int, with_lse: bool = False):
    """One query token per sequence over its paged context, for one group of rows at once.

    Whole blocks are gathered (a few large copies rather than one per token), and grouped-query
    heads are handled by reshaping the queries to [kv_heads, group] instead of expanding K/V.
    q: [H, b, D], float32 and already scaled. Returns [KVH, b, G, D] float32 (and the
    log-sum-exp [KVH, b, G] with with_lse): scores and softmax stay in float32 whatever the
    pool's dtype, since bf16 scores would be rounded before the softmax.
    """
    h, b, d = q.shape
    kv_heads = k_pool.shape[0]
    tables = group.block_tables.view(-1)
    keys = k_pool.view(kv_heads, -1, block_size, d).index_select(1, tables).view(kv_heads, b, -1, d).float()
    values = v_pool.view(kv_heads, -1, block_size, d).index_select(1, tables).view(kv_heads, b, -1, d).float()
    queries = q.view(kv_heads, h // kv_heads, b, d).transpose(1, 2)  # [KVH, b, G, D]
    scores = torch.matmul(queries, keys.transpose(-1, -2))  # [KVH, b, G, L]
    if group.mask is not None:
        scores.masked_fill_(~group.mask, float("-inf"))
    if with_lse:
        return _softmax_attend(scores, values)
    return torch.matmul(torch.softmax(scores, dim=-1), values)


def plan_decode_groups(lengths: list[int], slack: float = 2.0) -> list[tuple[int, int]]:
    """Cut decode rows, sorted by ascending context length, into [start, end) groups whose
    padded size (rows x longest) stays within `slack` x their real tokens."""
    groups: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start + 1) * n > slack * (total + n):
            groups.append((start, i))
            start, total = i, 0
        total += n
    if lengths:
        groups.append((start, len(lengths)))
    return groups


def _no_mask(*args, **kwargs) -> None:
    return None


def register() -> None:
    """Make "prefixgate_paged" a valid `attn_implementation` for transformers models."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    AttentionMaskInterface.register(PAGED_ATTENTION, _no_mask)
