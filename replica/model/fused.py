"""Fused projections: one matrix product for q/k/v and one for gate/up per decoder layer.

Applied after loading: each attention module's q_proj, k_proj and v_proj become one Linear
`qkv_proj` (weights and biases concatenated, outputs split) and each MLP's gate_proj and
up_proj become `gate_up_proj`, so a layer reads its input once and runs 4 matrix products
instead of 7. The modules stay transformers' own (layers, norms, rotary embedding, decoder
layer forward); only the fused modules' `forward` is replaced, by one that does exactly what
transformers' does in the same order (rotary embedding, Qwen3's q/k norms, the attention
interface and its sliding-window argument), so greedy output stays transformers'.

Only classes whose forward is known to be that are fused (FUSED_ATTENTION, FUSED_MLP); any
other model runs unfused, unchanged.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

FUSED_ATTENTION = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"})
FUSED_MLP = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


def fuse_projections(model: nn.Module) -> int:
    """Fuses every known attention and MLP module in place; returns how many."""
    fused = 0
    for module in model.modules():
        name = type(module).__name__
        if name in FUSED_ATTENTION:
            _fuse_attention(module)
        elif name in FUSED_MLP:
            _fuse_mlp(module)
        else:
            continue
        fused += 1
    return fused


def concat_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side (biases too; a part without
    bias contributes zeros when another has one). Built on the meta device and given the
    concatenated tensors: a randomly initialised Linear would cost a replica's start-up about
    half a second of initialisation thrown away."""
    weight = torch.cat([p.weight.detach() for p in parts])
    has_bias = any(p.bias is not None for p in parts)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta", dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([
            p.bias.detach() if p.bias is not None else weight.new_zeros(p.out_features) for p in parts
        ]), requires_grad=False)
    return fused


def _fuse_attention(module: nn.Module) -> None:
    # imports triton: not before a model loads (gpu_check sets triton's interpreter first)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    parts = [module.q_proj, module.k_proj, module.v_proj]
    module.qkv_sizes = [p.out_features for p in parts]
    module.qkv_proj = concat_linear(parts)
    del module.q_proj, module.k_proj, module.v_proj
    # Qwen2/3 give a layer its window (None on full-attention layers); Mistral passes the config's
    module.window = getattr(module, "sliding_window", getattr(module.config, "sliding_window", None))
    module.rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb
    module.attend = ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]
    module.forward = types.MethodType(_attention_forward, module)


def _attention_forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
    q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
    if hasattr(self, "q_norm"):  # Qwen3: RMSNorm per head, before the rotary embedding
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    q, k = self.rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    out, weights = self.attend(self, q, k, v.transpose(1, 2), attention_mask, dropout=0.0, scaling=self.scaling,
                          sliding_window=self.window, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _fuse_mlp(module: nn.Module) -> None:
    module.gate_up_proj = concat_linear([module.gate_proj, module.up_proj])
    del module.gate_proj, module.up_proj
    module.forward = types.MethodType(_mlp_forward, module)


def _mlp_forward(self, x):
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)
