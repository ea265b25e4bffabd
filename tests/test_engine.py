"""Greedy engine output must equal plain transformers generation token for token: a cache hit
changes where prefill starts, never the output."""

from __future__ import annotations

import random

import pytest
from transformers import AutoModelForCausalLM

from replica.engine import LLMEngine, SamplingParams
from tests.helpers.engine import TINY_FAMILIES, reference_greedy

pytestmark = pytest.mark.slow  # each test runs models beside transformers

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _prompts(seed: int, shared: int, tails: list[int], vocab: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(shared)]
    return [system + [rng.randrange(3, vocab) for _ in range(n)] for n in tails]


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def tiny(request, tiny_model_dirs):
    path = tiny_model_dirs[request.param]
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    return path, ref


def _expect(ref, prompts, n=12):
    return [reference_greedy(ref, p, n, stop_at_eos=False) for p in prompts]


def test_cold_full_and_partial_hits(tiny):
    path, ref = tiny
    engine = LLMEngine(path, block_size=4, num_blocks=128)
    prompts = _prompts(0, 17, [3, 6, 1, 9])
    expected = _expect(ref, prompts)

    cold = engine.generate(prompts[:1], GREEDY)[0]
    assert cold.token_ids == expected[0] and cold.num_cached_tokens == 0

    again = engine.generate(prompts[:1], GREEDY)[0]  # identical: every full block but the last token's
    assert again.token_ids == expected[0]
    assert again.num_cached_tokens == (len(prompts[0]) - 1) // 4 * 4

    partial = engine.generate(prompts[1:], GREEDY)  # shared 17-token system prompt: 4 blocks hit
    assert [o.token_ids for o in partial] == expected[1:]
    assert [o.num_cached_tokens for o in partial] == [16, 16, 16]


def test_requests_joining_while_others_decode(tiny):
    path, ref = tiny
    engine = LLMEngine(path, block_size=4, num_blocks=128, max_num_batched_tokens=16)
    prompts = _prompts(1, 10, [40, 2, 7, 30, 5])  # 50-token prompt is prefilled in chunks
    expected = _expect(ref, prompts)
    ids = [engine.add_request(p, GREEDY) for p in prompts[:2]]
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished or len(ids) < len(prompts):
        steps += 1
        if steps in (3, 5, 9):  # arrivals between steps, while earlier requests decode
            ids.append(engine.add_request(prompts[len(ids)], GREEDY))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[i] for i in ids] == expected


def test_one_token_prefill_chunks_beside_decodes(tiny):
    """A budget of 2 tokens per step: while one request decodes, the other's prompt advances one
    token a step, chunks that are neither a decode nor the prompt's end (they sample nothing)."""
    path, ref = tiny
    engine = LLMEngine(path, block_size=4, num_blocks=64, max_num_batched_tokens=2, max_num_seqs=2)
    prompts = _prompts(4, 0, [2, 9])
    expected = _expect(ref, prompts)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected


def test_eviction_and_preemption_pressure(tiny):
    path, ref = tiny
    # 6 requests of 22 + 12 tokens need 9 blocks each; a 24-block pool forces preemption
    engine = LLMEngine(path, block_size=4, num_blocks=24)
    prompts = _prompts(2, 8, [14, 14, 14, 14, 14, 14]) + _prompts(3, 20, [2])
    expected = _expect(ref, prompts)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.evictions > 0
    assert stats.blocks_used == 0 and stats.blocks_free + stats.blocks_cached == 24
    # after the pressure the shared prefix may be evicted; output is still exact
    assert [o.token_ids for o in engine.generate(prompts[:2], GREEDY)] == expected[:2]


def test_real_model_matches_transformers(default_model_dir, hf_reference):
    engine = LLMEngine(default_model_dir, block_size=16, num_blocks=256)
    system = "You are a concise assistant for a travel company. Answer in one short sentence. " * 3
    questions = ["What is the capital of France?", "Name a fruit that is yellow.", "What is 2 plus 2?"]
    prompts = [
        engine.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in questions
    ]
    params = SamplingParams(max_tokens=24)
    expected = [reference_greedy(hf_reference, p, 24) for p in prompts]

    first = engine.generate(prompts[:1], params)[0]
    assert first.token_ids == expected[0] and first.num_cached_tokens == 0
    assert "Paris" in first.text
    rest = engine.generate(prompts, params)  # full hit for the first, shared system prompt for the others
    assert [o.token_ids for o in rest] == expected
    assert rest[0].num_cached_tokens == (len(prompts[0]) - 1) // 16 * 16
    assert all(o.num_cached_tokens >= 16 * (len(system) // 80) for o in rest[1:])
    assert rest[0].text == first.text and first.finish_reason == "stop"
