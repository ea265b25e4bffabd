"""Engine API: bad input refused at submission, sampling controls, aborts, async streaming."""

from __future__ import annotations

import asyncio

import pytest

from replica.async_engine import AsyncLLMEngine
from replica.engine import InvalidRequestError, LLMEngine, SamplingParams
from router.protocol.messages import GenerateRequest


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    return LLMEngine(tiny_model_dirs["llama"], block_size=4, num_blocks=64)


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        ([], {}, "empty"),
        ([5, 384], {}, "token ids"),
        ([5, -1], {}, "token ids"),
        ([1] * 250, {"max_tokens": 10}, "context"),
        ([1] * 210, {"max_tokens": 50}, "context"),
    ],
)
def test_bad_prompts_are_refused(engine, prompt, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request(prompt, SamplingParams(**kwargs))
    assert not engine.has_unfinished


def test_request_larger_than_the_pool(tiny_model_dirs):
    small = LLMEngine(tiny_model_dirs["llama"], block_size=4, num_blocks=8)
    with pytest.raises(InvalidRequestError, match="blocks"):
        small.add_request([1] * 30, SamplingParams(max_tokens=5))


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5},
     {"top_k": -2}, {"seed": -1}, {"stop": [""]}],
)
def test_invalid_sampling_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_bad_request_does_not_disturb_others(engine):
    rid = engine.add_request([7, 8, 9, 10, 11], SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(InvalidRequestError):
        engine.add_request([], SamplingParams())
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    assert outs[-1].request_id == rid and len(outs[-1].token_ids) == 5


def test_seeded_sampling_is_reproducible(engine):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a, b = engine.generate([[5, 6, 7], [5, 6, 7]], p)
    assert a.token_ids == b.token_ids
    c = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True))[0]
    assert c.token_ids != a.token_ids


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate([[9, 9, 9]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    topk = engine.generate([[9, 9, 9]], SamplingParams(max_tokens=8, temperature=2.0, top_k=1, ignore_eos=True))[0]
    assert greedy.token_ids == topk.token_ids


def test_stop_token_ids_and_max_tokens(engine):
    ref = engine.generate([[4, 4, 4]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop_at = ref.token_ids[3]
    out = engine.generate([[4, 4, 4]], SamplingParams(max_tokens=10, stop_token_ids=[stop_at], ignore_eos=True))[0]
    first = ref.token_ids.index(stop_at)
    assert out.token_ids == ref.token_ids[: first + 1] and out.finish_reason == "stop"
    assert ref.finish_reason == "length" and len(ref.token_ids) == 10


def test_abort_frees_blocks(engine):
    rid = engine.add_request([3] * 20, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert engine.stats().blocks_used > 0
    assert engine.abort(rid) is True
    assert engine.abort(rid) is False
    assert engine.stats().blocks_used == 0 and not engine.has_unfinished


@pytest.mark.slow
def test_stop_strings_on_real_model(default_model_dir):
    engine = LLMEngine(default_model_dir, num_blocks=64)
    prompt = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    full = engine.generate([prompt], SamplingParams(max_tokens=16))[0]
    assert full.text == "The capital of France is Paris."
    cut = engine.generate([prompt], SamplingParams(max_tokens=16, stop=["France"]))[0]
    assert cut.text == "The capital of " and cut.finish_reason == "stop"


def test_async_streaming_and_cancellation(tiny_model_dirs):
    engine = LLMEngine(tiny_model_dirs["llama"], block_size=4, num_blocks=64)
    aengine = AsyncLLMEngine(engine)

    async def scenario():
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        deltas = [o async for o in aengine.generate(GenerateRequest(prompt_token_ids=[5, 6, 7, 8, 9], params=params))]
        assert [len(d.new_token_ids) for d in deltas] == [1] * 6
        assert deltas[-1].finished and deltas[-1].token_ids == [t for d in deltas for t in d.new_token_ids]

        async def consume_two():
            n = 0
            async for _ in aengine.generate(GenerateRequest(prompt_token_ids=[1] * 12, params=SamplingParams(max_tokens=100, ignore_eos=True))):
                n += 1
                if n == 2:
                    break  # client went away
            return n

        both = await asyncio.gather(consume_two(), consume_two())
        assert both == [2, 2]
        with pytest.raises(InvalidRequestError):
            async for _ in aengine.generate(GenerateRequest(prompt_token_ids=[], params=params)):
                pass

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=60))
        stats = aengine.stats()
        assert stats.running == 0 and stats.waiting == 0 and stats.blocks_used == 0
    finally:
        aengine.shutdown()


@pytest.mark.parametrize("temperature", [1e-9, 1e-6, 100.0])
def test_extreme_temperatures_never_break_the_step(engine, temperature):
    other = engine.add_request([3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=temperature, top_p=1e-9, seed=1, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    assert other not in engine.requests  # the neighbour finished normally in the same steps
