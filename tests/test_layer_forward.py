"""replica/model/layer_forward.py's layer forward against transformers', and the thread and
packing rules of cpu_attention.py and packed_linear.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from replica.kernels import attention, cpu_attention
from replica.model import fused, layer_forward, packed_linear

FAMILIES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
DTYPES = [torch.float32, torch.bfloat16]


def tiny(family: str, dtype: torch.dtype, attn: str = "sdpa") -> nn.Module:
    """Two layers, grouped-query heads, random weights (norm weights too, so they matter)."""
    config = FAMILIES[family](num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p, dtype=torch.float32) + 0.5)
            elif p.dim() == 1:  # Qwen2's q/k/v biases
                p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.1)
    return model


def inputs(model: nn.Module, tokens: int = 11) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    hidden = torch.randn(1, tokens, model.config.hidden_size).to(model.dtype)
    positions = torch.arange(3, 3 + tokens)[None]
    return hidden, model.model.rotary_emb(hidden, positions)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact in fp32; within bf16's rounding (in practice exact) for bf16."""
    if want.dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.inference_mode()
def test_layer_equals_transformers_layer(family, dtype):
    ref = tiny(family, dtype)
    ours = copy.deepcopy(ref)
    fused.fuse_projections(ours)
    layer = ours.model.layers[0]
    assert "forward" in vars(layer)  # owned: layer_forward's layer, not transformers'
    hidden, rope = inputs(ref)
    assert_same(layer(hidden.clone(), attention_mask=None, position_embeddings=rope),
                ref.model.layers[0](hidden.clone(), attention_mask=None, position_embeddings=rope))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.inference_mode()
def test_model_equals_transformers_model(family, dtype):
    ref = tiny(family, dtype)
    ours = copy.deepcopy(ref)
    fused.fuse_projections(ours)
    ids = torch.randint(0, 128, (1, 13), generator=torch.Generator().manual_seed(2))
    assert_same(ours(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_norms_and_rotary_bit_exact(dtype):
    torch.manual_seed(3)
    norm = Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    norm.weight.data = (torch.rand(64) + 0.5).to(dtype)
    x = (torch.randn(1, 9, 64) * 3).to(dtype)
    assert torch.equal(layer_forward.rms_norm(x, norm.weight, 1e-6), norm(x))
    heads = (torch.randn(1, 9, 3, 64) * 3).to(dtype)  # a strided view, as q/k of the fused qkv are
    view = torch.cat([heads, heads[:, :, :1]], dim=2)[:, :, :3]
    weights = (torch.rand(3, 64) + 0.5).to(dtype)
    want = torch.stack([weights[i] * Qwen3RMSNorm(64, eps=1e-6).to(dtype)(view[:, :, i]) for i in range(3)], dim=2)
    assert torch.equal(layer_forward.heads_norm(view, weights, 1e-6), want)
    cos, sin = torch.randn(1, 9, 64).to(dtype), torch.randn(1, 9, 64).to(dtype)
    q_ref, k_ref = apply_rotary_pos_emb(view[:, :, :2].transpose(1, 2), view[:, :, 2:].transpose(1, 2), cos, sin)
    rotated = layer_forward.rotate(view, layer_forward.rope_tables(cos, sin)).transpose(1, 2)
    assert torch.equal(rotated[:, :2], q_ref) and torch.equal(rotated[:, 2:], k_ref)


def test_paged_models_own_the_layer_loop():
    attention.register()
    paged = tiny("qwen3", torch.float32, attn=attention.PAGED_ATTENTION)
    fused.fuse_projections(paged)
    assert "forward" in vars(paged.model)
    assert paged.model.widest_product == 64 * 2 * 96  # gate_up
    other = tiny("qwen3", torch.float32)  # sdpa: transformers builds the masks, our layers run
    fused.fuse_projections(other)
    assert "forward" not in vars(other.model) and "forward" in vars(other.model.layers[1])


def test_small_steps_run_on_one_thread():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert layer_forward.step_threads(64 * 256, 16, adapters=False) == 2
        assert layer_forward.step_threads(64 * 256, 4096, adapters=False) is None  # 4096 x 16 k >= 2^23
        with layer_forward.one_thread(2):
            assert (torch.get_num_threads(), cpu_attention._ceiling.threads) == (1, 2)
        assert torch.get_num_threads() == 2 and cpu_attention._ceiling.threads is None
        with layer_forward.one_thread(None):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_decode_thread_rule():
    # 16 rows x 96 tokens, 2 heads of 64 over 1 K/V head: one task (16 rows x 2 heads fill a chunk)
    assert cpu_attention.threads_for(16, 2, 1, 64, 16 * 96, most=2) == 1
    assert cpu_attention.threads_for(64, 2, 1, 64, 64 * 96, most=2) == 1  # 0.8 M multiply-adds
    assert cpu_attention.threads_for(256, 2, 1, 64, 256 * 96, most=2) == 2  # 3.1 M
    assert cpu_attention.threads_for(256, 2, 1, 64, 256 * 96, most=1) == 1  # never above the caller's
    assert cpu_attention.threads_for(1, 16, 8, 128, 1000, most=16) == 2  # 2 M
    assert cpu_attention.threads_for(1, 2, 1, 64, 10**6, most=16) == 1  # one task: one thread


@torch.inference_mode()
def test_decode_same_on_any_thread_count():
    assert cpu_attention.library() is not None, "the C decode kernel did not build (scripts/bootstrap.sh installs gcc)"
    torch.manual_seed(4)
    rows, bs, blocks = 200, 16, 7  # ~2.9 M multiply-adds: more than one thread under a ceiling of 8
    k, v = torch.randn(2, rows * blocks * bs, 64), torch.randn(2, rows * blocks * bs, 64)
    tables = torch.randperm(rows * blocks).long()
    offsets, lens = torch.arange(rows + 1) * blocks, torch.randint(1, blocks * bs, (rows,))
    q = torch.randn(rows, 4, 64)
    outs = []
    for ceiling in (1, 8):
        cpu_attention.set_thread_ceiling(ceiling)
        try:
            out = torch.empty(rows, 4, 64)
            cpu_attention.decode(q, k, v, tables, offsets, lens, bs, 0.125, out)
            outs.append(out)
        finally:
            cpu_attention.set_thread_ceiling(None)
    assert torch.equal(outs[0], outs[1])


def test_packing_rule():
    assert not packed_linear.pays(nn.Linear(64, 256))  # the thin model's products
    assert not packed_linear.pays(nn.Linear(64, 2048))  # its lm_head (131 k weights)
    assert packed_linear.pays(nn.Linear(576, 576))  # the bundled model's smallest
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(576, 576))
    if not packed_linear.packable(model):
        pytest.skip("no oneDNN packing here")
    assert packed_linear.pack_linears(model) == 1
    assert type(model[0]) is nn.Linear and isinstance(model[1], packed_linear.PackedLinear)


def test_steps_with_adapter_rows_keep_their_threads():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert layer_forward.step_threads(64 * 256, 2, adapters=True) is None  # MKL's LoRA products: as before
    finally:
        torch.set_num_threads(before)
