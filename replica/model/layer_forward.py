"""Our own forward for the decoder layers (and the layer loop) of the fused families.

transformers' decoder layer costs a thin model's step more in Python and op launches than in
arithmetic: per layer a decorated __call__, ~20 nn.Module look-ups and calls, RMSNorm as five
ops each (four norms per Qwen3 layer), rotary as seven ops per tensor. Here a layer does the same
arithmetic in fewer ops, bit for bit:

- RMSNorm: torch's `F.rms_norm` (on CPU one op whose parts are transformers' pow, mean, add,
  rsqrt, mul, all in C++), in float32 and cast back before the weight multiplies, as
  transformers does (for fp32 the weight goes into the same op: bit-exact there; for bf16 it is
  multiplied after the cast, as transformers does, since inside the op it would be rounded once
  instead of twice). On other devices transformers' own op sequence: F.rms_norm there is a
  fused kernel whose reduction order we have not checked.
- Qwen3's q/k norms as one norm over q and k side by side (the heads' weights stacked once at
  fusing time) and rotary on q and k together: `rotate_half(x) * sin == roll(x, D/2) * sin_signed`
  with sin's first half negated once per step (x2 * -s == -(x2 * s) exactly), four ops for both.
- the cos/sin tables are derived once per step for all layers (transformers' rotary module,
  unchanged), modules are read from their `_modules` dicts, not through nn.Module.__getattr__.

Attention is still called through the layer's attention function (`attn.attend`, paged
attention with its torch.compile branch) with the sliding-window argument, as fused.py did.

Threads: at the token counts of a thin model's step each matrix product is a few microseconds
on one thread but ~80 us on two (the OpenMP team's wake-up; under OMP_WAIT_POLICY=PASSIVE and on
a shared machine), so a step whose widest product is under SMALL_STEP_MACS multiply-adds runs
on one thread: its forward, lm_head and sampler (ModelRunner.step_threads; not a compiled
forward, whose graph is guarded on the thread count);
the C decode kernel still picks its own count up to the caller's (replica/kernels/cpu_attention.py). oneDNN's packed products give the same bits on one thread as
on two; MKL's (F.linear, LoRA's products) not always (odd row counts): a step with adapter rows
keeps the caller's threads, so adapters' outputs stay what they were (tests/test_lora_serve.py
compares them with PEFT's greedy output).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from replica.kernels import cpu_attention

# below this many multiply-adds in the widest product of a layer (tokens x in x out), one thread is
# faster than two. Measured per call (F.linear, 1 vs 2 threads, OMP_WAIT_POLICY=PASSIVE,
# 2-core EPYC): 16 x 64 -> 256 8.5 us vs 82 us; 256 x 64 -> 256 (4.2 M) 87 vs 140 us; 1 x 576 -> 3072
# (1.8 M, packed) 110 vs 129 us; but 16 x 576 -> 960 (8.8 M) 175 vs 142 us
SMALL_STEP_MACS = 1 << 23


class Rope(NamedTuple):
    """One step's rotary tables, shaped for activations laid out [B, T, heads, D]."""

    cos: torch.Tensor
    sin: torch.Tensor
    sin_signed: torch.Tensor  # sin with its first half negated: rotate_half(x) * sin == roll(x, D/2) * this


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> Rope:
    """From transformers' rotary module output ([B, T, D] each), once per step."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return Rope(cos.unsqueeze(-2), sin.unsqueeze(-2), signed.unsqueeze(-2))


def rotate(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin`, the same products and sum in four ops.
    Under torch.compile transformers' own formula: inductor fuses the roll form with other
    roundings in bf16 (a compiled bf16 Qwen3 then left transformers' greedy output)."""
    if torch.compiler.is_compiling():
        half = x.shape[-1] // 2
        return x * rope.cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * rope.sin
    out = x * rope.cos
    return out.add_(torch.roll(x, x.shape[-1] // 2, -1).mul_(rope.sin_signed))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, cast back to x's dtype, times the weight."""
    if x.device.type != "cpu":
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype).mul_(weight)


def heads_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head (x: [..., heads, D]) by its own weight row (weight: [heads, D])."""
    if x.device.type != "cpu":
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype).mul_(weight)


def _norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, module._parameters["weight"], module.variance_epsilon)


def attention(attn: nn.Module, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None) -> torch.Tensor:
    """A fused attention module (fused.py: qkv_proj, heads, attend) on normed input x [B, T, hidden]."""
    heads, kv_heads = attn.heads
    shape = x.shape[:-1]
    qkv = attn._modules["qkv_proj"](x).view(*shape, -1, attn.head_dim)
    qk, v = qkv.split([heads + kv_heads, kv_heads], dim=-2)
    norm = attn.__dict__.get("qk_norm")
    if norm is not None:  # Qwen3: RMSNorm per head, before the rotary embedding
        qk = heads_norm(qk, *norm)
    q, k = rotate(qk, rope).transpose(1, 2).split([heads, kv_heads], dim=1)
    out, _ = attn.attend(attn, q, k, v.transpose(1, 2), mask, dropout=0.0, scaling=attn.scaling,
                         sliding_window=attn.window)
    return attn._modules["o_proj"](out.reshape(*shape, -1).contiguous())


def mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A fused MLP (fused.py: gate_up_proj): down(act(gate) * up)."""
    gate, up = module._modules["gate_up_proj"](x).chunk(2, dim=-1)
    act = F.silu(gate) if module.silu else module.act_fn(gate)
    return module._modules["down_proj"](act.mul_(up))


def layer(block: nn.Module, hidden: torch.Tensor, rope: Rope, mask: torch.Tensor | None) -> torch.Tensor:
    """One decoder layer: transformers' pre-norm residual blocks (residual + x is x + residual exactly)."""
    mods = block._modules
    h = attention(mods["self_attn"], _norm(mods["input_layernorm"], hidden), rope, mask).add_(hidden)
    return mlp(mods["mlp"], _norm(mods["post_attention_layernorm"], h)).add_(h)


def layer_forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
    """The decoder layer's forward (transformers' signature; cache arguments are unused here)."""
    return layer(self, hidden_states, rope_tables(*position_embeddings), attention_mask)


def model_forward(self: nn.Module, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None, **kwargs):
    """The base model's forward for paged attention (which takes its masks from the step's
    metadata, so none is built): embeddings, rotary tables once, the layers, the final norm."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None]
    rope = rope_tables(*self.rotary_emb(hidden, position_ids))
    layers = list(self._modules["layers"]._modules.values())[: self.config.num_hidden_layers]
    for block in layers:
        hidden = layer(block, hidden, rope, None)
    return BaseModelOutputWithPast(last_hidden_state=_norm(self.norm, hidden))


def step_threads(widest_product: int, tokens: int, adapters: bool) -> int | None:
    """The caller's thread count if a step of `tokens` tokens through a model whose widest product
    is `widest_product` (in x out) should run on one thread instead (see SMALL_STEP_MACS), else None.
    adapters: the step has adapter rows, whose products (MKL's) stay on the caller's threads."""
    threads = torch.get_num_threads()
    if adapters or threads == 1 or tokens * widest_product >= SMALL_STEP_MACS:
        return None
    return threads


@contextmanager
def one_thread(threads: int | None) -> Iterator[None]:
    """Run the body on one thread (threads None: as it is); the C decode kernel may still use up
    to `threads` (its own rule, replica/kernels/cpu_attention.py)."""
    if threads is None:
        yield
        return
    torch.set_num_threads(1)
    cpu_attention.set_thread_ceiling(threads)
    try:
        yield
    finally:
        cpu_attention.set_thread_ceiling(None)
        torch.set_num_threads(threads)
