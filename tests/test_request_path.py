"""One request from the gateway's parse to the engine's Sequence (router/protocol/messages.py
GenerateRequest): built once by the gateway, checked once where it enters a replica, handed as it
is to the backend and the engine, and its prompt ids copied once on the way: by the Sequence,
which extends its own working list. Ray's pickling between the processes is the transfer itself;
the test runs it too."""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace

import msgspec
import pytest

from gateway.errors import APIError
from gateway.openai_models import CompletionRequest
from gateway.request_builder import build_requests
from replica.backends.local_backend import ModelBackend, SimBackend
from replica.backends.sim_engine import SimEngine
from replica.serve.request_stream import request_chunks
from router.protocol.messages import EndChunk, ErrorChunk, GenerateRequest, checked_request
from router.protocol.sampling import MAX_LOGPROBS, MAX_STOP, SamplingParams


class _Record:
    done = False

    def output(self, out) -> None: ...

    def close(self) -> None: ...


def _host(backend):
    return SimpleNamespace(replica_id="me", draining=False, backend=backend, kv_pull=None, handover=None, audit=None,
                           metrics=SimpleNamespace(request=_Record), settings=SimpleNamespace(stream_interval_s=0.05))


def _body(prompt: list[int], **fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": prompt, **fields})


def _sequences_made(engine) -> list:
    """Every Sequence `engine` makes from a request, recorded as it is made."""
    made = []
    make = engine.new_sequence

    def recording(request):
        seq = make(request)
        made.append(seq)
        return seq

    engine.new_sequence = recording
    return made


def _sequence_of(backend, request):
    """Run `request` to its end on `backend` (then shut down); the one Sequence its engine made."""
    made = _sequences_made(backend.engine.engine)
    try:
        chunks = _run(backend, request)
    finally:
        backend.shutdown()
    assert isinstance(chunks[-1], EndChunk), chunks[-1]
    [seq] = made
    return seq


def _run(backend, request) -> list:
    async def go():
        return [c async for c in request_chunks(_host(backend), request, None)]

    return asyncio.run(go())


def test_the_gateway_builds_each_choice_from_one_checked_params_and_one_prompt_list():
    body = _body(list(range(10, 50)), n=3, seed=7, max_tokens=4, logprobs=2)
    reqs = build_requests(body, body.prompt, "text", max_tokens=4, vocab_size=100, session="s", tenant="t",
                          adapter=None)
    assert len(reqs) == 3 and len({r.request_id for r in reqs}) == 3
    assert all(r.prompt_token_ids is body.prompt for r in reqs)  # no copy per choice
    assert [r.params.seed for r in reqs] == [7, 8, 9]  # each choice its own draws
    assert {r.params.logprobs for r in reqs} == {2} and {r.cache_salt for r in reqs} == {"t"}
    with pytest.raises(APIError) as refused:
        build_requests(_body([1, 2], logit_bias={"100": 1.0}), [1, 2], "", max_tokens=4, vocab_size=100,
                       session=None, tenant=None, adapter=None)
    assert refused.value.status == 400 and "logit_bias" in str(refused.value.body)


@pytest.mark.parametrize("pickled", [False, True], ids=["in-process", "through-pickle"])
def test_prompt_ids_are_copied_once_from_the_gateway_to_the_sim_engines_sequence(pickled):
    """The list the gateway parsed is the list the Sequence holds as its prompt (through Ray:
    the list pickling made); the Sequence's own working list is the one copy."""
    body = _body(list(range(10, 90)), max_tokens=3)
    [req] = build_requests(body, body.prompt, "", max_tokens=3, vocab_size=49152, session=None, tenant=None,
                           adapter=None)
    sent = pickle.loads(pickle.dumps(req)) if pickled else req
    seq = _sequence_of(SimBackend(SimEngine(num_blocks=64)), sent)
    assert seq.prompt_token_ids is sent.prompt_token_ids
    assert seq.token_ids is not seq.prompt_token_ids and seq.token_ids[:80] == body.prompt


def test_prompt_ids_are_copied_once_on_our_engine(tiny_model_dirs):
    body = _body(list(range(10, 50)), max_tokens=2)
    [req] = build_requests(body, body.prompt, "", max_tokens=2, vocab_size=100, session=None, tenant=None,
                           adapter=None)
    seq = _sequence_of(asyncio.run(ModelBackend.create(_engine_config(tiny_model_dirs["llama"]), 1)), req)
    assert seq.prompt_token_ids is body.prompt and seq.token_ids is not body.prompt


def _engine_config(path: str):
    from replica.engine_config import EngineConfig

    return EngineConfig(model=path, num_blocks=32)


def test_a_request_is_checked_where_it_enters_a_replica_field_by_field():
    """Ray unpickles whatever was sent: a wrong field is a 400 chunk naming it, never half-run;
    a bad prompt id is refused by the engine's one check of the prompt (refuse_unfit)."""
    backend = SimBackend(SimEngine(num_blocks=64))
    try:
        bad = GenerateRequest(prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=2))
        bad.params.temperature = "hot"
        [_, refused] = _run(backend, bad)
        assert isinstance(refused, ErrorChunk) and refused.code == 400 and "params.temperature" in refused.message
        ids = GenerateRequest(prompt_token_ids=[1, "2", 3], params=SamplingParams(max_tokens=2))
        [_, refused] = _run(backend, ids)
        assert isinstance(refused, ErrorChunk) and refused.code == 400 and "prompt token ids" in refused.message
        [_, refused] = _run(backend, {"prompt_token_ids": [1], "params": {"max_tokens": 0}})
        assert isinstance(refused, ErrorChunk) and refused.code == 400 and "max_tokens" in refused.message
    finally:
        backend.shutdown()
    with pytest.raises(msgspec.ValidationError, match="prompt_token_ids"):
        checked_request(GenerateRequest(prompt_token_ids=(1, 2), params=SamplingParams()))


def test_the_limits_are_defined_once_and_the_gateway_schema_reads_them():
    from gateway import openai_models

    assert openai_models.MAX_LOGPROBS is MAX_LOGPROBS and openai_models.MAX_STOP is MAX_STOP == 4
    with pytest.raises(ValueError, match=f"at most {MAX_STOP}"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP + 1)])
    SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP)])
