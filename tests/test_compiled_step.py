"""The compiled tests (the rest of the suite runs eager): EngineConfig(compile=True) gives the
same greedy tokens as the eager engine and as transformers, from one graph compiled at start
for every batch size, so no request pays a compile; in fp32 for every tiny family, and in bf16
within its tie rules (loadtest/device/parity.py, as tests/test_engine_bf16.py checks the eager path)."""

from __future__ import annotations

import random

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from loadtest.device import parity
from replica.engine import LLMEngine, SamplingParams
from tests.helpers.engine import reference_greedy

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # tiny models of its own, compiled


def test_compiled_greedy_equals_eager_and_transformers(tiny_model_dirs):
    path = tiny_model_dirs["qwen3"]  # q/k norms and fused projections, the most to get right
    rng = random.Random(7)
    system = [rng.randrange(3, 384) for _ in range(9)]
    prompts = [system + [rng.randrange(3, 384) for _ in range(n)] for n in (1, 6, 13)] + [[5]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    expected = [reference_greedy(ref, p, 10, stop_at_eos=False) for p in prompts]

    compiled = LLMEngine(path, block_size=4, num_blocks=64, max_num_batched_tokens=8, compile=True)
    stats = compiled.runner.compile_stats
    # one graph per thread count the steps run on: a tiny model's steps all run on one thread
    # (layer_forward.step_threads), so with more threads there is a second graph, for them
    counts = 2 if torch.get_num_threads() > 1 else 1
    assert stats.graphs == counts and stats.sizes == [2, 16] * counts
    assert stats.fx_cache_hits + stats.fx_cache_misses == counts
    graphs = counters["stats"]["unique_graphs"]
    alone = compiled.generate(prompts[3:], params)  # one-token prompt, then 1-row decodes: padded to 2
    together = compiled.generate(prompts, params)  # chunked prefill beside decodes, prefix hits
    assert counters["stats"]["unique_graphs"] == graphs  # no request compiled anything

    eager = LLMEngine(path, block_size=4, num_blocks=64, max_num_batched_tokens=8)
    assert [o.token_ids for o in eager.generate(prompts, params)] == expected
    assert [o.token_ids for o in together] == expected
    assert alone[0].token_ids == expected[3]
    assert any(o.num_cached_tokens for o in together)


@pytest.mark.parametrize("family", [f for f in parity.FAMILIES if f != "qwen3"])  # qwen3: the test above
def test_compiled_fp32_equals_transformers(family, tmp_path):
    result = parity.check_family(family, parity.save_tiny(family, tmp_path), dtype="float32", compile=True)
    assert result.exact == result.prompts, result
    assert all(c >= 12 for c in result.cached_tokens)


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # bf16 linears go through the packed custom op
def test_compiled_bf16_keeps_the_tie_rules(family, tmp_path):
    result = parity.check_family(family, parity.save_tiny(family, tmp_path), dtype="bfloat16", compile=True)
    assert result.agreed == result.prompts, result
    assert result.exact >= result.prompts - 1, result
