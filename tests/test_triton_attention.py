"""The Triton paged-attention kernels (replica/kernels/triton_attention.py) under Triton's CPU
interpreter: the same outputs as the torch path on random steps built by the engine's own
ModelRunner.prepare (GQA, context lengths off block boundaries, a cascade's shared prefix,
chunked and cached prefills), and the same greedy tokens through the engine.

The interpreter must be chosen before triton is first imported, so each check runs in a
subprocess with TRITON_INTERPRET=1: the setting never reaches other tests in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # the kernels, and the engine on them

ROOT = Path(__file__).resolve().parents[1]
SMALL_TILES = (16, 16, 16)  # several tiles per row and per chunk on these tiny steps

# name: (StepShape fields, dtype, tile sizes or None for the defaults, tolerance on |torch - triton|)
CASES = {
    "fp32 gqa2 bs4": ({}, "float32", SMALL_TILES, 1e-5),
    "fp32 gqa2 bs4 default tiles": ({}, "float32", None, 1e-5),
    "bf16 gqa2 bs4": ({}, "bfloat16", SMALL_TILES, 3e-2),  # both outputs are rounded to bf16
    "fp16 gqa2 bs4": ({}, "float16", SMALL_TILES, 4e-3),
    "fp32 gqa4 d128 bs8": (dict(heads=8, kv_heads=2, head_dim=128, block_size=8, shared_blocks=2,
                               shared_decodes=(17, 20, 31), decodes=(3, 12), prefills=((0, 9), (16, 20))),
                          "float32", SMALL_TILES, 1e-5),
    "bf16 mha d64 bs32 (tile < block)": (dict(heads=2, kv_heads=2, head_dim=64, block_size=32, shared_blocks=1,
                                             shared_decodes=(33, 40, 50, 64, 70), decodes=(5,), prefills=((32, 17),)),
                                        "bfloat16", SMALL_TILES, 3e-2),
    "fp32 decodes only": (dict(shared_blocks=0, shared_decodes=(), prefills=()), "float32", SMALL_TILES, 1e-5),
    "fp32 prefills only": (dict(shared_blocks=0, shared_decodes=(), decodes=(), prefills=((0, 7), (5, 23), (12, 2))),
                           "float32", SMALL_TILES, 1e-5),
    "fp32 equal fresh prompts batched": (dict(prefills=((0, 7), (5, 23), (0, 7), (0, 7), (0, 3))), "float32", SMALL_TILES,
                                         1e-5),
}


def _interpreted(code: str) -> object:
    """Run `code` in a fresh interpreter-mode Python; it prints one JSON value as its last line."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def kernel_errors() -> dict[str, float]:
    cases = {name: (shape, dtype, tiles) for name, (shape, dtype, tiles, _) in CASES.items()}
    return _interpreted(f"""
        import json, torch
        from loadtest.device import triton_check
        from replica.kernels.triton_attention import TileSizes
        errors = {{}}
        for name, (shape, dtype, tiles) in {cases!r}.items():
            errors[name] = triton_check.max_error(triton_check.StepShape(**shape), getattr(torch, dtype), "cpu",
                                                  TileSizes(*tiles) if tiles else None)
        print(json.dumps(errors))
    """)


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_the_torch_path(kernel_errors, name):
    assert kernel_errors[name] <= CASES[name][3], kernel_errors[name]


def test_engine_greedy_tokens_equal_with_the_triton_backend(tmp_path):
    """A tiny GQA Qwen3 (fp32): the same greedy tokens from both backends, over prompts sharing
    a system prompt (decode cascades), chunked prefills (16-token budget) and, in the second
    round, prefills over a cached prefix."""
    from transformers import Qwen3Config

    from loadtest.device.gpu_check import save_random_model

    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    path = save_random_model(config, tmp_path / "qwen3", torch.float32)
    system = list(range(10, 31))
    rounds = [[system + [40 + i, 50 + i] for i in range(3)], [system + [60, 61, 62], [7, 8, 9]]]
    tokens = _interpreted(f"""
        import json
        from loadtest.device.triton_check import engine_tokens
        args = dict(block_size=4, num_blocks=96, max_num_batched_tokens=16)
        print(json.dumps([engine_tokens({path!r}, b, {rounds!r}, 8, **args) for b in ("torch", "triton")]))
    """)
    assert tokens[0] == tokens[1]
    assert [len(t) for batch in tokens[1] for t in batch] == [8] * 5
