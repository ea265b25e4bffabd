"""Random LoRA adapters of a model, built and saved with peft itself (non-zero B, fixed seeds):
what the LoRA benchmark serves and what the tests check our engine against (tests/helpers/lora.py)."""

from __future__ import annotations

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ATTENTION_MLP = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: str, out_dir: str, targets: list[str], rank: int, seed: int,
                 alpha: int = 16, rslora: bool = False) -> str:
    """A random LoRA adapter of the model in `model_dir`, saved as peft saves it; returns out_dir."""
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
