"""Stream migration: a request continued on another engine from the tokens already sent joins
into exactly the text, tokens and usage of an undisturbed run; the gateway's retry wrapper
resends the right continuation, bounds its attempts and passes bad requests through."""

from __future__ import annotations

import asyncio

import pytest

from gateway.migration import MigrationPolicy, ResilientStream, derive_seed
from replica.engine import LLMEngine, SamplingParams
from router.protocol.messages import GenerateRequest

PROMPT = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def engines(default_model_dir):
    """Two engines of the real model: the one that 'dies' and the one that takes over."""
    return LLMEngine(default_model_dir, num_blocks=256), LLMEngine(default_model_dir, num_blocks=256)


def _stream(engine: LLMEngine, prompt: list[int], params: SamplingParams, **extra) -> list:
    rid = engine.add_request(prompt, params, **extra)
    outs = []
    while True:
        for out in engine.step():
            if out.request_id == rid:
                outs.append(out)
                if out.finished:
                    return outs


def _migrate(engines, prompt, params, cut: int):
    """Run on engine A up to `cut` streamed outputs, then continue on engine B as the gateway does."""
    a, b = engines
    first = _stream(a, prompt, params)
    sent = first[:cut]
    ids = [t for o in sent for t in o.new_token_ids]
    text = "".join(o.new_text for o in sent)
    rest = _stream(b, prompt, params, prefix_output_token_ids=ids, prefix_text_len=len(text))
    joined_ids = ids + [t for o in rest for t in o.new_token_ids]
    joined_text = text + "".join(o.new_text for o in rest)
    return first, rest, joined_ids, joined_text


@pytest.mark.parametrize("cut", [1, 9, 23])
def test_greedy_continuation_is_identical(engines, cut):
    prompt = engines[0].apply_chat_template(PROMPT)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    first, rest, ids, text = _migrate(engines, prompt, params, cut)
    assert ids == first[-1].token_ids
    assert text == first[-1].text
    final = rest[-1]
    assert final.finished and final.finish_reason == "length"
    assert len(final.token_ids) == 40  # usage: completion tokens count what was sent before
    assert final.num_prompt_tokens == len(prompt)
    assert len(rest) == 40 - cut  # max_tokens accounted for the sent tokens


def test_stop_string_spanning_the_cut(engines):
    """The stop string's first half was held back before the cut: the continuation finds the
    whole stop string and emits nothing of it."""
    a, _ = engines
    prompt = a.tokenize("The capital of France is Paris. The capital of Germany is")
    plain = _stream(a, prompt, SamplingParams(max_tokens=16, ignore_eos=True))[-1].text
    stop = plain.strip().split(" ")[1]  # a word that appears a little way in
    assert stop and stop in plain
    params = SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop])
    reference = _stream(a, prompt, params)
    for cut in range(1, len(reference)):
        _, rest, _, text = _migrate(engines, prompt, params, cut)
        assert text == reference[-1].text, cut
        assert rest[-1].finish_reason == "stop" and stop not in text


def test_seeded_continuation_is_reproducible(engines):
    prompt = engines[0].apply_chat_template(PROMPT)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=derive_seed(42, 5), ignore_eos=True)
    _, rest1, ids1, text1 = _migrate(engines, prompt, params, 5)
    _, rest2, ids2, text2 = _migrate(engines, prompt, params, 5)
    assert len(ids1) == 20 and ids1[5:] == ids2[5:] and text1 == text2


def test_continuation_is_validated(engines):
    from replica.engine import InvalidRequestError

    a, _ = engines
    with pytest.raises(InvalidRequestError):
        a.add_request([1, 2, 3], SamplingParams(max_tokens=3), prefix_output_token_ids=[5, 6, 7])
    with pytest.raises(InvalidRequestError):
        a.add_request([1, 2, 3], SamplingParams(max_tokens=8), prefix_output_token_ids=[10**9])


# ---- the gateway's wrapper, against scripted replicas (pure logic) --------------------------
class ReplicaDied(Exception):
    pass


def _script(*runs):
    """A replica call that plays one scripted run per attempt; "die" raises mid-stream."""
    calls: list[GenerateRequest] = []

    async def call(req: GenerateRequest):
        run = runs[len(calls)]
        calls.append(req)
        for chunk in run:
            if chunk == "die":
                raise ReplicaDied("actor died")
            yield chunk

    return call, calls


def _collect(call, req, policy=None):
    async def go():
        stream = ResilientStream(call, req, policy or MigrationPolicy(backoff_s=0.0), (ReplicaDied,))
        return [c async for c in stream]

    return asyncio.run(asyncio.wait_for(go(), 30))


START = {"type": "start", "replica": "A", "route": None}


def _delta(ids, text):
    return {"type": "delta", "token_ids": ids, "text": text}


def test_wrapper_continues_with_sent_tokens_and_derived_seed():
    end = {"type": "end", "finish_reason": "length", "prompt_tokens": 3, "cached_tokens": 9, "completion_tokens": 4}
    call, calls = _script(
        [START, _delta([7], "a"), _delta([8], ""), "die"],
        [{**START, "replica": "B"}, {"type": "error", "code": 503, "message": "draining", "retry": True}],
        [{**START, "replica": "C"}, _delta([9], "bc"), _delta([10], "d"), end],
    )
    req = GenerateRequest([1, 2, 3], {"max_tokens": 4, "seed": 5})
    chunks = _collect(call, req)
    assert [c["replica"] for c in chunks if c["type"] == "start"] == ["A", "B", "C"]
    assert "".join(c["text"] for c in chunks if c["type"] == "delta") == "abcd"
    assert calls[0] is req
    for again in calls[1:]:
        assert again.prompt_token_ids == [1, 2, 3] and again.prefix_output_token_ids == [7, 8]
        assert again.prefix_text_len == 1 and again.params["seed"] == derive_seed(5, 2)
        assert again.request_id != req.request_id
    final = chunks[-1]
    assert final["type"] == "end" and final["cached_tokens"] == 3  # capped at the prompt
    assert [m["recompute_tokens"] for m in final["migrations"]] == [5, 5]


def test_wrapper_retries_before_first_token_with_the_same_request():
    end = {"type": "end", "finish_reason": "stop", "prompt_tokens": 2, "cached_tokens": 0, "completion_tokens": 1}
    call, calls = _script([START, "die"], [START, _delta([4], "x"), end])
    req = GenerateRequest([1, 2], {"max_tokens": 4, "seed": 5})
    chunks = _collect(call, req)
    assert calls[1].prefix_output_token_ids == [] and calls[1].params == req.params
    assert chunks[-1]["type"] == "end"


def test_wrapper_bounds_attempts_and_passes_bad_requests_through():
    call, calls = _script(*[[START, _delta([1], "a"), "die"]] * 3)
    chunks = _collect(call, GenerateRequest([1], {"max_tokens": 9}), MigrationPolicy(max_attempts=3, backoff_s=0.0))
    assert len(calls) == 3
    assert chunks[-1]["type"] == "error" and chunks[-1]["code"] == 503 and chunks[-1]["exhausted"]
    bad = {"type": "error", "code": 400, "message": "bad"}
    call, calls = _script([START, bad])
    chunks = _collect(call, GenerateRequest([1], {"max_tokens": 9}))
    assert len(calls) == 1 and chunks[-1] == bad


def test_a_continuation_drops_the_first_routes_pull_hint():
    """The hint may name the replica that just died: a continuation is routed afresh."""
    from gateway.migration import continuation
    from router.protocol.messages import KvSource

    req = GenerateRequest([1, 2, 3], {"max_tokens": 4}, kv_source=KvSource("dead-replica", 2),
                          route={"reason": "pull", "replica": "r1", "matched_blocks": 0})
    cont = continuation(req, [7, 8], 2)
    assert cont.kv_source is None and cont.route is None
    assert cont.prefix_output_token_ids == [7, 8] and cont.prompt_token_ids == [1, 2, 3]
