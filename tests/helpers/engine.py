"""The engine's references: the tiny model families the tests build, and plain transformers
greedy decoding. torch and transformers load on first use, not at import."""

from __future__ import annotations

TINY_FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


def tiny_config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family]
    if family == "qwen3":
        common["head_dim"] = 16
    return cls(**common)


def reference_greedy(model, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
    """Plain transformers greedy decoding: the ground truth the engine must match."""
    import torch

    kwargs = {} if stop_at_eos else {"eos_token_id": None}
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kwargs,
    )
    return out[0, len(prompt):].tolist()
