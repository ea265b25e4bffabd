"""LoRA adapters for the tests, built with peft itself (loadtest/bench/lora_adapters.py), and
peft's own forward as the reference the engine must match. torch and peft load on first use."""

from __future__ import annotations

from loadtest.bench.lora_adapters import ATTENTION as ATTENTION
from loadtest.bench.lora_adapters import ATTENTION_MLP as ATTENTION_MLP
from loadtest.bench.lora_adapters import make_adapter as make_adapter


def peft_model(model_dir: str, adapter_dir: str):
    """transformers + PeftModel on the adapter, fp32, eval: the reference."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return PeftModel.from_pretrained(base, adapter_dir).eval()
