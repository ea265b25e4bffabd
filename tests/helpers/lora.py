"""LoRA adapters for the tests, built with peft itself (non-zero B, fixed seeds), and peft's
own forward as the reference the engine must match. torch and peft load on first use."""

from __future__ import annotations

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ATTENTION_MLP = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: str, out_dir: str, targets: list[str], rank: int, seed: int,
                 alpha: int = 16, rslora: bool = False) -> str:
    """A random LoRA adapter of the model in `model_dir`, saved as peft saves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                        init_lora_weights=False, lora_dropout=0.0)  # False: B is random, not zero
    model = get_peft_model(base, config)
    with torch.no_grad():  # large enough that the adapter changes the greedy output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(out_dir)
    return out_dir


def peft_model(model_dir: str, adapter_dir: str):
    """transformers + PeftModel on the adapter, fp32, eval: the reference."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return PeftModel.from_pretrained(base, adapter_dir).eval()
