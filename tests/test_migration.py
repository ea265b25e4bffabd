"""Stream migration: a request continued on another engine from the tokens already sent joins
into exactly the text, tokens and usage of an undisturbed run; the gateway's retry wrapper
resends the right continuation, bounds its attempts and passes bad requests through."""

from __future__ import annotations

import asyncio

import pytest

from gateway.migration import MigrationPolicy, ResilientStream, derive_seed
from replica.engine import LLMEngine, SamplingParams
from router.protocol.messages import (
    AliveChunk,
    DeltaChunk,
    EndChunk,
    ErrorChunk,
    GenerateRequest,
    StartChunk,
    encode_chunk,
)

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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_seeded_continuation_is_reproducible(engines):
    prompt = engines[0].apply_chat_template(PROMPT)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=derive_seed(42, 5), ignore_eos=True)
    _, rest1, ids1, text1 = _migrate(engines, prompt, params, 5)
    _, rest2, ids2, text2 = _migrate(engines, prompt, params, 5)
    assert len(ids1) == 20 and ids1[5:] == ids2[5:] and text1 == text2


@pytest.mark.slow
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
            if chunk == "freeze":  # a frozen replica: silent, neither output nor an error
                await asyncio.Event().wait()
            yield chunk if isinstance(chunk, bytes) else encode_chunk(chunk)

    return call, calls


def _request(prompt: list[int], **params) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=prompt, params=SamplingParams(**params))


def _collect(call, req, policy=None):
    async def go():
        stream = ResilientStream(call, req, policy or MigrationPolicy(backoff_s=0.0), (ReplicaDied,))
        return [c async for c in stream]

    return asyncio.run(asyncio.wait_for(go(), 30))


START = StartChunk("A")


def _delta(ids, text):
    return DeltaChunk(ids, text)


def _start(replica: str) -> StartChunk:
    return StartChunk(replica)


def _kinds(chunks) -> list[str]:
    return [type(c).__struct_config__.tag for c in chunks]


def test_wrapper_continues_with_sent_tokens_and_derived_seed():
    end = EndChunk("length", prompt_tokens=3, cached_tokens=9, completion_tokens=4)
    call, calls = _script(
        [START, _delta([7], "a"), _delta([8], ""), "die"],
        [_start("B"), ErrorChunk(503, "draining", retry=True)],
        [_start("C"), _delta([9], "bc"), _delta([10], "d"), end],
    )
    req = _request([1, 2, 3], max_tokens=4, seed=5)
    chunks = _collect(call, req)
    assert [c.replica for c in chunks if isinstance(c, StartChunk)] == ["A", "B", "C"]
    assert "".join(c.text for c in chunks if isinstance(c, DeltaChunk)) == "abcd"
    assert calls[0] is req
    for again in calls[1:]:
        assert again.prompt_token_ids == [1, 2, 3] and again.prefix_output_token_ids == [7, 8]
        assert again.prefix_text_len == 1 and again.params.seed == derive_seed(5, 2)
        assert again.request_id != req.request_id
    final = chunks[-1]
    assert isinstance(final, EndChunk) and final.cached_tokens == 3  # capped at the prompt
    assert [m["recompute_tokens"] for m in final.migrations] == [5, 5]


def test_wrapper_retries_before_first_token_with_the_same_request():
    end = EndChunk("stop", prompt_tokens=2, cached_tokens=0, completion_tokens=1)
    call, calls = _script([START, "die"], [START, _delta([4], "x"), end])
    req = _request([1, 2], max_tokens=4, seed=5)
    chunks = _collect(call, req)
    assert calls[1].prefix_output_token_ids == [] and calls[1].params == req.params
    assert isinstance(chunks[-1], EndChunk)


def test_wrapper_bounds_attempts_and_passes_bad_requests_through():
    call, calls = _script(*[[START, _delta([1], "a"), "die"]] * 3)
    chunks = _collect(call, _request([1], max_tokens=9), MigrationPolicy(max_attempts=3, backoff_s=0.0))
    assert len(calls) == 3
    assert isinstance(chunks[-1], ErrorChunk) and chunks[-1].code == 503 and chunks[-1].exhausted
    bad = ErrorChunk(400, "bad")
    call, calls = _script([START, bad])
    chunks = _collect(call, _request([1], max_tokens=9))
    assert len(calls) == 1 and chunks[-1] == bad


def test_wrapper_ends_a_malformed_chunk_with_a_502_not_a_retry():
    """A chunk that is not the protocol's (another version, a bug) fails the same way on every
    replica: the request ends with a clear 502 instead of six futile attempts."""
    call, calls = _script([START, b"\x81\xa4type\xa5delta"])  # a delta without its fields
    chunks = _collect(call, _request([1], max_tokens=9))
    assert len(calls) == 1 and isinstance(chunks[-1], ErrorChunk) and chunks[-1].code == 502


def test_a_continuation_is_a_new_request_with_the_sent_tokens():
    """The router's decision (and its pull hint, which may name the replica that just died)
    travels beside the request, so a continuation cannot carry it: it is routed afresh."""
    from gateway.migration import continuation

    req = _request([1, 2, 3], max_tokens=4)
    cont = continuation(req, [7, 8], 2)
    assert not hasattr(cont, "route") and not hasattr(cont, "kv_source")
    assert cont.prefix_output_token_ids == [7, 8] and cont.prompt_token_ids == [1, 2, 3]
    assert cont.request_id != req.request_id and req.prefix_output_token_ids == []


def test_wrapper_moves_a_request_off_a_silent_replica_and_drops_keepalives():
    """A replica that started the request and then went silent (frozen: Ray sees no death) is
    left after the stall timeout, and the stream continues elsewhere; "alive" chunks keep a
    slow replica from counting as silent and never reach the caller."""
    end = EndChunk("length", prompt_tokens=2, cached_tokens=0, completion_tokens=2)
    call, calls = _script(
        [START, _delta([7], "a"), "freeze"],
        [_start("B"), AliveChunk(), AliveChunk(), _delta([8], "b"), end],
    )
    req = _request([1, 2], max_tokens=2)
    chunks = _collect(call, req, MigrationPolicy(backoff_s=0.0, stall_timeout_s=0.2))
    assert len(calls) == 2 and calls[1].prefix_output_token_ids == [7]
    assert _kinds(chunks) == ["start", "delta", "start", "delta", "end"]
    assert "ReplicaStalled" in chunks[-1].migrations[0]["reason"]


def test_wrapper_waits_without_bound_before_the_replica_starts():
    """Before "start" the request may sit in Serve's queue: the stall guard does not apply."""
    end = EndChunk("stop", prompt_tokens=1, cached_tokens=0, completion_tokens=1)
    queued = asyncio.Event()

    async def call(req):
        await asyncio.sleep(0.5)  # longer than the stall timeout, before any chunk
        queued.set()
        for chunk in (START, _delta([4], "x"), end):
            yield encode_chunk(chunk)

    chunks = _collect(call, _request([1], max_tokens=1), MigrationPolicy(backoff_s=0.0, stall_timeout_s=0.1))
    assert queued.is_set() and isinstance(chunks[-1], EndChunk) and chunks[-1].migrations == []


def test_keepalive_marks_silence_and_closes_its_source():
    from replica.serve.keepalive import with_keepalive

    closed = asyncio.Event()
    release = asyncio.Event()

    async def source():
        try:
            yield 1
            await release.wait()  # silent until released
            yield 2
            await asyncio.Event().wait()  # silent for good
        finally:
            closed.set()

    async def go():
        out = []
        stream = with_keepalive(source(), 0.05)
        async for item in stream:
            out.append(item)
            if out.count(None) == 2 and not release.is_set():
                release.set()
            if item is None and 2 in out:
                break  # leave while a read of the source is pending
        await stream.aclose()
        return out

    out = asyncio.run(asyncio.wait_for(go(), 30))
    two = out.index(2)
    assert out[0] == 1 and out[two + 1:] == [None] and out.count(None) >= 3 and set(out[1:two]) == {None}
    assert closed.is_set()  # leaving early cancelled the pending read and closed the source


def test_a_cancelled_reader_leaves_a_stream_that_closes_cleanly():
    """The gateway cancels a choice's reader (client gone, n > 1) and then closes its stream:
    the cancellation lands at once and closing raises nothing (no "already running")."""
    reading = asyncio.Event()

    async def call(req):
        yield encode_chunk(START)
        yield encode_chunk(_delta([1], "a"))
        reading.set()
        await asyncio.Event().wait()  # a replica still working, nothing to send yet

    async def go():
        stream = ResilientStream(call, _request([1], max_tokens=9), MigrationPolicy(backoff_s=0.0, stall_timeout_s=30),
                                 (ReplicaDied,)).__aiter__()

        async def read():
            return [c async for c in stream]

        task = asyncio.create_task(read())
        await reading.wait()
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()  # raises if the generator chain were still running

    asyncio.run(asyncio.wait_for(go(), 30))
