"""Paged attention plugged into transformers' model definitions.

The model runs on one flattened sequence of tokens from many requests (no padding in the
matmuls). transformers calls our attention function per layer; it writes the new K/V into
the shared pool at `slot_mapping`, then attends each request's queries over that request's
K/V gathered from the pool through its block table. Cached prefix blocks are read in place.

Decode rows are grouped by context length (see DecodeGroup) so the K/V read per layer follows
the real tokens, and blocks that several decodes' contexts start with (a shared system prompt
hit in the prefix cache) are read once for all of them (cascade attention, see DecodeCascade);
decode softmax runs in float32 also for bf16 pools. All of it is described by metadata
(replica/kernels/attention_metadata.py) that
ModelRunner.prepare builds once per step as tensors (block tables, masks and what every layer
derives from them), so a layer runs tensor operations only; under torch.compile this whole
function is one opaque operator of the graph (`prefixgate::paged_attention`,
replica/model/compiled_step.py). Models whose attention
needs what is not implemented here (soft-capping, sinks, a sliding window shorter than the
context) are refused at load time with UnsupportedModelError.

Registered as the attention implementation "prefixgate_paged" (plus a mask function that
builds nothing: masks come from the step's metadata), so any transformers model that uses
the attention interface (Llama, Qwen2, Qwen3, Mistral, ...) runs unmodified.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from replica.kernels import cpu_attention
from replica.kernels.attention_metadata import AttentionMetadata, DecodeGroup

PAGED_ATTENTION = "prefixgate_paged"


_step = threading.local()  # .meta: the step the calling thread's forward runs (engines in one process each have theirs)
_backend = None  # None: the torch path below; else attends in its place (set_backend)


def set_metadata(meta: AttentionMetadata | None) -> None:
    _step.meta = meta


def default_backend() -> bool:
    """True while the torch path (and on CPU its C decode kernel) attends, not a set_backend one."""
    return _backend is None


def set_backend(name: str) -> None:
    """Which attention runs: "torch" (default; CPU and CUDA) or "triton" (replica/kernels/triton_attention.py's
    kernels for a GPU, or its interpreter), given the same queries, pools and metadata."""
    global _backend
    if name not in ("torch", "triton"):
        raise ValueError(f"unknown attention backend {name!r}")
    if name == "triton":
        from replica.kernels import triton_attention

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
    _refuse_unimplemented(kwargs)
    window = kwargs.get("sliding_window")
    if torch.compiler.is_compiling():  # one opaque call in the compiled graph (replica/model/compiled_step.py)
        return torch.ops.prefixgate.paged_attention(query, key, value, module.layer_idx, scaling, window), None
    return attend(module.layer_idx, query, key, value, scaling, window), None


def attend(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
           window: int | None) -> torch.Tensor:
    """One layer's attention for the step in the current metadata; returns [1, T, H, D].

    The compiled step pads the batch to a size it has compiled: rows past the metadata's
    tokens are padding, not written to the pool, and come back as zeros.
    """
    meta = getattr(_step, "meta", None)
    if meta is None:
        raise RuntimeError("paged attention called outside the engine's forward pass")
    if window is not None and meta.max_context > window:
        raise UnsupportedModelError(f"context of {meta.max_context} tokens exceeds the sliding window of {window}")
    n, padded = meta.slot_mapping.numel(), query.shape[2]
    if padded > n:
        query, key, value = query[:, :, :n], key[:, :, :n], value[:, :, :n]
    k_pool, v_pool = meta.pool.k[layer], meta.pool.v[layer]
    k_pool.index_copy_(1, meta.slot_mapping, key[0])  # key: [1, KVH, T, D]
    v_pool.index_copy_(1, meta.slot_mapping, value[0])

    q = query[0]  # [H, T, D]
    if _backend is not None:
        out = _backend(q, k_pool, v_pool, meta, scaling)
    else:
        out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, H, D]
        _prefill(q, key, value, k_pool, v_pool, meta, scaling, out)
        nd = meta.num_decodes
        if nd and meta.decode_tables is not None:
            scale = scaling if scaling is not None else q.shape[2] ** -0.5
            cpu_attention.decode(q[:, :nd].transpose(0, 1), k_pool, v_pool, meta.decode_tables, meta.decode_offsets,
                                 meta.decode_lens, meta.block_size, scale, out[:nd])
        elif nd:
            _decode(q[:, :nd], k_pool, v_pool, meta, scaling, out)
    if padded > n:
        out = F.pad(out, (0, 0, 0, 0, 0, padded - n))
    return out.unsqueeze(0)


@torch.library.custom_op("prefixgate::paged_attention", mutates_args=())
def _attend_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float | None,
               window: int | None) -> torch.Tensor:
    """attend() as an operator the compiler keeps opaque: writes the pool, reads the metadata."""
    return attend(layer, query, key, value, scaling, window)


@_attend_op.register_fake
def _(query, key, value, layer, scaling, window):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def _prefill(q, key, value, k_pool, v_pool, meta: AttentionMetadata, scaling: float | None, out: torch.Tensor) -> None:
    """Each prefill chunk attends over its request's context on its own (SDPA): the new K/V as
    computed when nothing is cached, else the whole context gathered from the pool. Prompts of
    one length with nothing cached, side by side (a segment's count), are one batched call."""
    for seg in meta.prefills:
        if seg.count > 1:
            _fresh_batch(q, key, value, seg.q_start, seg.q_end, seg.count, scaling, out)
            continue
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


def _fresh_batch(q, key, value, start: int, end: int, count: int, scaling: float | None, out: torch.Tensor) -> None:
    """`count` prompts of equal length in rows [start, end), each causal over its own new K/V:
    their rows viewed as a batch [count, heads, length, D], no copy."""
    h, d, kv_heads = q.shape[0], q.shape[2], key.shape[1]
    n = (end - start) // count
    qs = q[:, start:end].view(h, count, n, d).transpose(0, 1)
    ks = key[0, :, start:end].view(kv_heads, count, n, d).transpose(0, 1)
    vs = value[0, :, start:end].view(kv_heads, count, n, d).transpose(0, 1)
    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=True)
    out[start:end].view(count, n, h, d).copy_(o.transpose(1, 2))


def _decode(q: torch.Tensor, k_pool, v_pool, meta: AttentionMetadata, scaling: float | None, out: torch.Tensor) -> None:
    """All decode rows, one cascade at a time: the shared prefix's keys are multiplied once by
    all the cascade's rows, then each length group scores its own blocks and takes one softmax
    over prefix and suffix scores together (no partial results to merge).

    Scores, softmax and the weighted sums stay in float32 whatever the pool's dtype, since bf16
    scores would be rounded before the softmax. Grouped-query heads are handled by laying the
    queries out [kv_heads, rows, group, D] instead of expanding K/V.
    """
    h, b, d = q.shape
    kv_heads = k_pool.shape[0]
    g = h // kv_heads
    scale = scaling if scaling is not None else d**-0.5
    q = q.view(kv_heads, g, b, d).transpose(1, 2).contiguous().float().mul_(scale)  # [KVH, B, G, D]
    k_blocks = k_pool.view(kv_heads, -1, meta.block_size, d)
    v_blocks = v_pool.view(kv_heads, -1, meta.block_size, d)
    for cascade in meta.decode_cascades:
        prefix = None
        if cascade.prefix_blocks is not None:
            keys = k_blocks.index_select(1, cascade.prefix_blocks).view(kv_heads, -1, d).float()
            rows = q[:, cascade.start : cascade.end].reshape(kv_heads, -1, d)  # rows ordered (b, g)
            scores = torch.matmul(rows, keys.transpose(-1, -2)).view(kv_heads, cascade.end - cascade.start, g, -1)
            values = v_blocks.index_select(1, cascade.prefix_blocks).view(kv_heads, -1, d).float()
            prefix = scores, values
        for group in cascade.groups:
            _attend_group(q, k_blocks, v_blocks, group, prefix, cascade.start, out)


def _attend_group(q, k_blocks, v_blocks, group: DecodeGroup, prefix, first_row: int, out: torch.Tensor) -> None:
    """One length group: scores over its own blocks (gathered whole, a few large copies rather
    than one per token), joined to its rows' prefix scores if any, softmax, weighted sums."""
    kv_heads, _, _, d = k_blocks.shape
    b = group.end - group.start
    keys = k_blocks.index_select(1, group.flat_tables).view(kv_heads, b, -1, d).float()
    values = v_blocks.index_select(1, group.flat_tables).view(kv_heads, b, -1, d).float()
    scores = torch.matmul(q[:, group.start : group.end], keys.transpose(-1, -2))  # [KVH, b, G, L]
    if group.invalid is not None:
        scores.masked_fill_(group.invalid, float("-inf"))
    if prefix is None:
        o = torch.matmul(torch.softmax(scores, dim=-1), values)
    else:
        p_scores, p_values = prefix
        lo, hi = group.start - first_row, group.end - first_row
        n = p_values.shape[1]
        probs = torch.softmax(torch.cat([p_scores[:, lo:hi], scores], dim=-1), dim=-1)  # [KVH, b, G, Lp + L]
        o = torch.matmul(probs[..., n:], values)
        o.view(kv_heads, -1, d).baddbmm_(probs.view(kv_heads, -1, probs.shape[-1])[..., :n], p_values)
    out[group.start : group.end].view(b, kv_heads, -1, d).copy_(o.transpose(0, 1))


def _refuse_unimplemented(kwargs: dict) -> None:
    """Never run a model wrong: features checked at load time, checked again per call (the
    sliding window against the step's contexts in attend())."""
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"paged attention does not implement {name}")


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
