"""Paged attention as Triton kernels, the GPU form of replica/kernels/attention.py's torch path.

`forward` takes what the torch path takes once the step's new K/V are in the pool (queries,
the layer's pools, the step's AttentionMetadata) and returns the same [T, H, D] output, so it
plugs in through `attention.set_backend("triton")`. Two kernels, one launch each per layer:

- decode: one program per (decode row, KV head) walks that row's block table, all the query
  heads of its GQA group at once (K/V read once per group, not once per query head);
- prefill: one program per (tile of a chunk's queries, query head) over the chunk's context
  slots, causal with the chunk's offset (its queries are the context's last tokens).

Scores, softmax (online, flash-attention style) and accumulation are float32 whatever the
pool's dtype. The torch path's decode cascades (a shared prefix read once for many rows) are
flattened back into per-row block tables: on a GPU the shared blocks are re-read from cache,
which is what vLLM's paged-attention kernel does too. Prefill segments are assumed to carry the
runner's offset-causal mask (step_inputs.StepInputs builds no other kind); the mask tensor is not read.

Without a GPU the kernels run under Triton's interpreter: TRITON_INTERPRET=1 must be set before
triton is first imported, so in a process of its own (loadtest.device.triton_check.use_interpreter_on_cpu).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from replica.kernels.attention_metadata import AttentionMetadata

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read by triton.jit below, at import
# the interpreter's tl.dot gets bfloat16 operands wrong (float16 and float32 are right): there the
# prefill kernel multiplies them in float32, on a GPU in bfloat16 with float32 accumulation


@triton.jit
def _decode_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, scale,
    stride_qh, stride_qt, stride_kh, stride_ks, stride_ot, stride_oh, stride_tb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)  # offsets into a pool can pass 2**31 elements
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    qmask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + heads[:, None] * stride_qh + row * stride_qt + d[None, :], mask=qmask, other=0.0)
    q = q.to(tl.float32) * scale
    n = tl.load(lens_ptr + row)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for start in range(0, n, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        tmask = t < n
        block = tl.load(tables_ptr + row * stride_tb + t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + t % BLOCK_SIZE
        kv_off = kvh * stride_kh + slot[:, None] * stride_ks + d[None, :]
        kv_mask = tmask[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_N]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    o = acc / l_i[:, None]
    o_ptr = out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, slots_ptr, tiles_ptr, scale,
    stride_qh, stride_qt, stride_kh, stride_ks, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = (head // GROUP).to(tl.int64)
    q0 = tl.load(tiles_ptr + tile * 4)
    q_end = tl.load(tiles_ptr + tile * 4 + 1)
    kv_start = tl.load(tiles_ptr + tile * 4 + 2)
    kv_len = tl.load(tiles_ptr + tile * 4 + 3)
    r = q0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dmask = (d < HEAD_DIM)[None, :]
    rmask = (r < q_end)[:, None] & dmask
    pos = kv_len - q_end + r  # each query's position: the chunk is its context's last tokens
    q = tl.load(q_ptr + head * stride_qh + r[:, None] * stride_qt + d[None, :], mask=rmask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(kv_len, kv_len - q_end + q0 + BLOCK_M)  # nothing past the tile's last query
    for start in range(0, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        tmask = t < kv_len
        slot = tl.load(slots_ptr + kv_start + t, mask=tmask, other=0).to(tl.int64)
        kv_off = kvh * stride_kh + slot[:, None] * stride_ks + d[None, :]
        kv_mask = tmask[:, None] & dmask
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N] float32
        s = tl.where((t[None, :] <= pos[:, None]) & tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    o = acc / l_i[:, None]
    o_ptr = out_ptr + r[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=rmask)


@dataclass
class TileSizes:
    """Tokens per program iteration; powers of two (at least 16 for the prefill's tl.dot).
    Not tuned on a GPU: none has been available to this work."""

    decode_n: int = 32
    prefill_m: int = 64
    prefill_n: int = 64


@dataclass
class _StepPlan:
    """The step's metadata as the kernels read it, built once per step (the first layer)."""

    tables: torch.Tensor | None  # [num_decodes, width] int32 block ids, cascades flattened
    lens: torch.Tensor | None  # [num_decodes] int32 context lengths
    slots: torch.Tensor | None  # every prefill chunk's context slots, concatenated, int32
    tiles: torch.Tensor | None  # [tiles, 4] int32: first query row, chunk end row, slots offset, context length


_last: tuple[AttentionMetadata, TileSizes, _StepPlan] | None = None


def forward(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata, scaling: float | None,
    tiles: TileSizes | None = None,
) -> torch.Tensor:
    """q [H, T, D] over one layer's pools [KVH, slots, D] (new K/V already written) -> [T, H, D]."""
    tiles = tiles or TileSizes()
    h, t, d = q.shape
    kv_heads = k_pool.shape[0]
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_pool.stride(-1) == 1 and k_pool.stride() == v_pool.stride(), "pools must be contiguous alike"
    scale = scaling if scaling is not None else d**-0.5
    plan = _plan(meta, tiles)
    out = q.new_empty(t, h, d)
    group = h // kv_heads
    dims = dict(HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d))
    strides = (q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), out.stride(0), out.stride(1))
    if plan.tables is not None:
        _decode_kernel[(meta.num_decodes, kv_heads)](
            out, q, k_pool, v_pool, plan.tables, plan.lens, scale, *strides, plan.tables.stride(0),
            GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 2), BLOCK_SIZE=meta.block_size,
            BLOCK_N=tiles.decode_n, **dims,
        )
    if plan.tiles is not None:
        _prefill_kernel[(plan.tiles.shape[0], h)](
            out, q, k_pool, v_pool, plan.slots, plan.tiles, scale, *strides,
            GROUP=group, BLOCK_M=tiles.prefill_m, BLOCK_N=tiles.prefill_n, **dims,
            UPCAST=INTERPRETED and k_pool.dtype == torch.bfloat16,
        )
    return out


def _plan(meta: AttentionMetadata, tiles: TileSizes) -> _StepPlan:
    global _last
    last = _last
    if last is not None and last[0] is meta and last[1] == tiles:
        return last[2]
    plan = _StepPlan(*_decode_plan(meta), *_prefill_plan(meta, tiles.prefill_m))
    _last = (meta, tiles, plan)
    return plan


def _decode_plan(meta: AttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Each decode row's whole block table and context length, as StepInputs gathered them."""
    if not meta.num_decodes:
        return None, None
    if meta.decode_block_table is None or meta.decode_lens is None:
        raise ValueError("the step's metadata carries no decode block table (StepInputs builds it for Triton)")
    return meta.decode_block_table, meta.decode_lens


def _prefill_plan(meta: AttentionMetadata, block_m: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Concatenated context slots of the prefill chunks and one row per tile of BLOCK_M queries.
    A chunk with no cached prefix attends over its own new tokens, whose slots are slot_mapping's."""
    if not meta.prefills:
        return None, None
    slots, tiles, offset = [], [], 0
    for seg in meta.prefills:
        for q_start, q_end in seg.parts():
            s = seg.kv_slots if seg.kv_slots is not None else meta.slot_mapping[q_start:q_end]
            slots.append(s)
            tiles += [(m, q_end, offset, s.numel()) for m in range(q_start, q_end, block_m)]
            offset += s.numel()
    device = meta.slot_mapping.device
    return torch.cat(slots).to(torch.int32), torch.tensor(tiles, dtype=torch.int32).to(device, non_blocking=True)
