"""Fused projections: one matrix product for q/k/v and one for gate/up per decoder layer.

Applied after loading: each attention module's q_proj, k_proj and v_proj become one Linear
`qkv_proj` (weights and biases concatenated, outputs split) and each MLP's gate_proj and
up_proj become `gate_up_proj`, so a layer reads its input once and runs 4 matrix products
instead of 7. The modules stay transformers' own (layers, norms, rotary embedding); their
`forward`s are replaced by replica/model/layer_forward.py's, which do exactly what
transformers' do, bit for bit, in fewer ops (rotary embedding, Qwen3's q/k norms, the attention
interface and its sliding-window argument), so greedy output stays transformers'. A decoder
layer whose attention and MLP are fused runs layer_forward's layer; a base model all of whose
layers do, under paged attention (masks come from the step's metadata), runs its layer loop.

Only classes whose forward is known to be that are fused (FUSED_ATTENTION, FUSED_MLP,
FUSED_LAYERS, FUSED_MODELS, FUSED_NORMS); any other model runs unfused, unchanged.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from replica.kernels.attention import PAGED_ATTENTION
from replica.model import layer_forward

_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
FUSED_ATTENTION = frozenset(f"{f}Attention" for f in _FAMILIES)
FUSED_MLP = frozenset(f"{f}MLP" for f in _FAMILIES)
FUSED_LAYERS = frozenset(f"{f}DecoderLayer" for f in _FAMILIES)
FUSED_MODELS = frozenset(f"{f}Model" for f in _FAMILIES)
FUSED_NORMS = frozenset(f"{f}RMSNorm" for f in _FAMILIES)


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
    for module in model.modules():
        if type(module).__name__ in FUSED_MODELS:
            _own_model(module)
    return fused


def _own_layer(layer: nn.Module) -> bool:
    """The layer runs layer_forward's layer if all its parts are ones it knows; whether it does."""
    if type(layer).__name__ not in FUSED_LAYERS:
        return False
    attn, mlp = layer._modules.get("self_attn"), layer._modules.get("mlp")
    norms = [layer._modules.get("input_layernorm"), layer._modules.get("post_attention_layernorm")]
    if not (hasattr(attn, "qkv_proj") and hasattr(mlp, "gate_up_proj")):
        return False
    if any(type(n).__name__ not in FUSED_NORMS for n in norms):
        return False
    layer.forward = types.MethodType(layer_forward.layer_forward, layer)
    return True


def _own_model(model: nn.Module) -> None:
    """Every layer on layer_forward; the layer loop too under paged attention (no masks to build)."""
    layers = list(model.layers)
    owned = [_own_layer(layer) for layer in layers]
    if not all(owned) or model.config._attn_implementation != PAGED_ATTENTION:
        return
    model.widest_product = max(_widest(layer) for layer in layers)
    model.forward = types.MethodType(layer_forward.model_forward, model)


def _widest(layer: nn.Module) -> int:
    """in x out of the layer's largest matrix product (the thread rule of layer_forward)."""
    return max(m.in_features * m.out_features for m in layer.modules() if hasattr(m, "in_features"))


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
    module.heads = (module.qkv_sizes[0] // module.head_dim, module.qkv_sizes[1] // module.head_dim)
    module.attend = ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]
    if hasattr(module, "q_norm"):  # Qwen3: one norm over q and k side by side, each head its weight
        module.qk_norm = _stacked_norm(module)
    module.forward = types.MethodType(_attention_forward, module)


def _stacked_norm(module: nn.Module) -> tuple[torch.Tensor, float]:
    """q_norm's weight for each query head and k_norm's for each K/V head, as rows [heads, D]."""
    q, k = module.q_norm, module.k_norm
    if q.variance_epsilon != k.variance_epsilon or type(q).__name__ not in FUSED_NORMS:
        raise ValueError(f"{type(module).__name__}: q_norm and k_norm differ in kind or epsilon")
    heads, kv_heads = module.heads
    weight = torch.cat([q.weight.detach().expand(heads, -1), k.weight.detach().expand(kv_heads, -1)])
    return weight, q.variance_epsilon


def _attention_forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
    """transformers' attention forward (for a caller of the module itself; layers call layer_forward's)."""
    rope = layer_forward.rope_tables(*position_embeddings)
    return layer_forward.attention(self, hidden_states, rope, attention_mask), None


def _fuse_mlp(module: nn.Module) -> None:
    module.gate_up_proj = concat_linear([module.gate_proj, module.up_proj])
    del module.gate_proj, module.up_proj
    module.silu = type(module.act_fn).__name__ in ("SiLUActivation", "SiLU")
    module.forward = types.MethodType(layer_forward.mlp, module)
