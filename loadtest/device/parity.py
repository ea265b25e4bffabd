"""Greedy parity against transformers on tiny random models, on any device and dtype.

Shared by tests/test_engine_bf16.py (CPU) and scripts/gpu_check.sh (CUDA), so the check that
runs on a GPU is the one the test suite runs here. bf16 rounding can produce exact ties
between the top logits of a random model; a divergence is accepted only at such a tie, judged
by the reference's own logits at that position (within one bf16 step of its top).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


def tiny_config(family: str, initializer_range: float = 0.1):
    """Same shapes as the test suite's tiny models; std 0.1 keeps logits less flat than 0.02."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=initializer_range,
    )
    if family == "qwen3":
        common["head_dim"] = 16
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family]
    return cls(**common)


def save_tiny(family: str, path: Path, seed: int = 1234) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_config(family)).save_pretrained(path)
    return str(path)


def reference_greedy(ref, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=ref.device)
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                       pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def agrees(ref, prompt: list[int], ours: list[int], expected: list[int]) -> bool:
    """Equal, or equal up to a first divergence where the two tokens tie at bf16 resolution."""
    k = next((i for i, (a, b) in enumerate(zip(ours, expected, strict=True)) if a != b), None)
    if k is None:
        return True
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + expected[:k]], device=ref.device)).logits[0, -1].float()
    top = logits[expected[k]]
    return bool(logits[ours[k]] >= top - abs(top) * 2**-7)


@dataclass
class ParityResult:
    family: str
    prompts: int
    exact: int  # outputs identical to transformers
    agreed: int  # identical, or diverging only at a bf16 tie
    cached_tokens: list[int]

    @property
    def ok(self) -> bool:
        return self.agreed == self.prompts and self.exact >= self.prompts - 1


def check_family(family: str, path: str, device: str = "cpu", dtype: str = "bfloat16", n: int = 10,
                 compile: bool = False) -> ParityResult:
    """A cold request, then a batch with prefix hits, a chunked prompt and mixed-length decodes
    (compile: through the compiled forward, replica/model/compiled_step.py)."""
    from transformers import AutoModelForCausalLM

    from replica.engine import LLMEngine, SamplingParams

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    ref = ref.to(device).eval()
    rng = random.Random(7)
    system = [rng.randrange(3, 384) for _ in range(13)]
    prompts = [system + [rng.randrange(3, 384) for _ in range(k)] for k in (2, 9, 30, 70)]
    expected = [reference_greedy(ref, p, n) for p in prompts]
    engine = LLMEngine(path, block_size=4, num_blocks=128, dtype=dtype, max_num_batched_tokens=32, device=device,
                       compile=compile)
    greedy = SamplingParams(max_tokens=n, ignore_eos=True)
    engine.generate(prompts[:1], greedy)  # fills the cache with the shared prefix
    outs = engine.generate(prompts, greedy)
    ours = [o.token_ids for o in outs]
    return ParityResult(
        family=family, prompts=len(prompts),
        exact=sum(o == e for o, e in zip(ours, expected, strict=True)),
        agreed=sum(agrees(ref, p, o, e) for p, o, e in zip(prompts, ours, expected, strict=True)),
        cached_tokens=[o.num_cached_tokens for o in outs],
    )
