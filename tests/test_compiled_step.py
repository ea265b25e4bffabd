"""The one compiled test (the rest of the suite runs eager): EngineConfig(compile=True) gives the
same greedy tokens as the eager engine and as transformers, from one graph compiled at start
for every batch size, so no request pays a compile."""

from __future__ import annotations

import random

from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from replica.engine import LLMEngine, SamplingParams
from tests.conftest import reference_greedy


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
    assert stats.graphs == 1 and stats.seconds > 0 and stats.fx_cache_hits + stats.fx_cache_misses == 1
    graphs = counters["stats"]["unique_graphs"]
    alone = compiled.generate(prompts[3:], params)  # one-token prompt, then 1-row decodes: padded to 2
    together = compiled.generate(prompts, params)  # chunked prefill beside decodes, prefix hits
    assert counters["stats"]["unique_graphs"] == graphs  # no request compiled anything

    eager = LLMEngine(path, block_size=4, num_blocks=64, max_num_batched_tokens=8)
    assert [o.token_ids for o in eager.generate(prompts, params)] == expected
    assert [o.token_ids for o in together] == expected
    assert alone[0].token_ids == expected[3]
    assert any(o.num_cached_tokens for o in together)
