"""The engine seam's pure rules (no Ray, no vLLM): which backend settings name, what a vLLM
app is refused for before any replica starts, pull hints only between replicas that can pull,
and vLLM's min_tokens / ignore_eos on our engine's sampler and through the gateway's schema."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gateway.config import AppConfig
from gateway.openai_models import CompletionRequest
from replica.backends.engine_protocol import ENGINE_NAMES, Capabilities, EngineBackend, ModelFacts
from replica.backends.engines import engine_spec, spec_of
from replica.backends.local_backend import ModelBackend, SimBackend
from replica.backends.model_spec import ModelEngineSettings
from replica.backends.sim_spec import SimEngineSettings
from replica.model.sampler import Sampler
from replica.serve.replica_settings import ReplicaSettings
from router.decider import Decider
from router.latency_model import LatencyModels
from router.policy import AffinityPullPolicy, ReplicaView, RouteRequest
from router.protocol.sampling import SamplingParams


def test_settings_carry_one_engine_by_its_tag():
    """A replica's settings hold exactly one engine's (a tagged union): through Serve as plain
    data tagged with the engine's name, decoded into the same type and checked on entry."""
    assert isinstance(ReplicaSettings().engine, ModelEngineSettings)
    for name in ENGINE_NAMES:
        settings = ReplicaSettings(engine=AppConfig(engine=name).engine_settings("m"), torch_threads=2)
        wire = settings.to_dict()
        assert wire["engine"]["engine"] == name and isinstance(wire["engine"]["config"], dict)
        back = ReplicaSettings.from_dict(wire)
        assert back == settings and spec_of(back.engine) is engine_spec(name)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.engine\.engine"):
        ReplicaSettings.from_dict({"engine": {"engine": "tensorrt"}})
    with pytest.raises(msgspec.ValidationError, match="vllm"):  # one engine's settings, not a sim's with vLLM's
        ReplicaSettings.from_dict({"engine": {"engine": "sim", "config": {}, "vllm": {}}})
    with pytest.raises(msgspec.ValidationError, match=r"\$\.engine\.config\.num_blocks"):
        ReplicaSettings.from_dict({"engine": {"engine": "sim", "config": {"num_blocks": "many"}}})


def test_vllm_block_size_defaults_to_32_and_16_is_refused_before_start():
    assert AppConfig(engine="vllm").block_size == 32 and AppConfig().block_size == 16
    assert AppConfig(engine="vllm", kv_cache_mb=1536).engine_settings("m").vllm.cpu_kvcache_gib == 2
    with pytest.raises(ValueError, match="multiple of 32"):
        AppConfig(engine="vllm", block_size=16)
    assert AppConfig(engine="vllm", block_size=16, device="cuda").block_size == 16  # vLLM's CPU backend's rule
    with pytest.raises(ValueError, match="unknown engine"):
        AppConfig(engine="tensorrt")
    with pytest.raises(ValueError, match=r"vllm: unknown keys \['no_such_knob'\]"):
        AppConfig(engine="vllm", vllm={"no_such_knob": 1})
    with pytest.raises(ValueError, match="cpu_kvcache_gib"):
        AppConfig(engine="vllm", vllm={"cpu_kvcache_gib": "lots"})


def test_each_engine_spec_holds_its_rules():
    """What differs by engine comes from its spec: the default block size, the settings it
    refuses (named, with where the engine's own knob is), its replicas' Ray actor."""
    assert [engine_spec(n).default_block_size for n in ENGINE_NAMES] == [16, 16, 32]
    for kwargs, says in [({"engine": "vllm", "kv_host_mb": 64}, "K/V tiers; engine vllm has none"),
                         ({"engine": "sim", "dtype": "bfloat16"}, "dtype is our engine's; engine sim"),
                         ({"engine": "vllm", "compile": True}, "enforce_eager=false")]:
        with pytest.raises(ValueError, match=says):
            AppConfig(**kwargs)
    AppConfig(dtype="bfloat16", compile=True, kv_host_mb=64)  # our engine takes all three
    sim, vllm = AppConfig(engine="sim"), AppConfig(engine="vllm", vllm_python="/opt/vllm/bin/python")
    assert sim.engine_spec.actor_options(sim) == {"num_cpus": sim.sim_replica_num_cpus}
    assert vllm.engine_spec.actor_options(vllm)["runtime_env"] == {"py_executable": "/opt/vllm/bin/python"}
    assert "runtime_env" not in AppConfig().engine_spec.actor_options(AppConfig())


def test_pull_hints_only_between_replicas_that_can_pull():
    """The deepest holder cannot export (a vLLM replica): no pull is offered from it; a
    replica that cannot import is never told to pull, even from one that can export."""
    policy = AffinityPullPolicy(seed=0)
    request = RouteRequest(block_hashes=list(range(40)), num_prompt_tokens=40 * 16, block_size=16)
    holder = ReplicaView("vllm-a", matched_blocks=40, running=8, waiting=8, kv_pull=False)
    idle = ReplicaView("ours-b", matched_blocks=0)
    decision = policy.decide(request, [holder, idle])
    assert decision.pull is None
    exporter = ReplicaView("ours-a", matched_blocks=40, running=8, waiting=8)
    cannot_import = ReplicaView("vllm-b", matched_blocks=0, kv_pull=False)
    decision = policy.decide(request, [exporter, cannot_import])
    assert decision.pull is None or decision.replica_id != "vllm-b"
    able = ReplicaView("ours-b", matched_blocks=0)
    assert AffinityPullPolicy(seed=0).decide(request, [exporter, able]).pull.replica_id == "ours-a"  # the same case pulls


def test_decider_reads_kv_pull_from_the_heartbeat():
    d = Decider.__new__(Decider)

    class Loads:
        latency = LatencyModels()  # no samples: no step model, no prediction

        def get(self, rid):
            return {"vllm": {"running": 1, "kv_pull": 0}, "ours": {"running": 1, "kv_pull": 1}}.get(rid)

    d.loads = Loads()
    assert d._view("ours", 0, 0, {}).kv_pull and not d._view("vllm", 0, 0, {}).kv_pull
    assert not d._view("gone", 0, 0, {"running": 4}).kv_pull  # no heartbeat: no pull either


class _Row:
    def __init__(self, rid, params, out):
        self.request_id, self.params, self.prompt_token_ids, self._out = rid, params, [1, 2], out

    @property
    def output_token_ids(self):
        return self._out

    @property
    def num_output_tokens(self):
        return len(self._out)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(3, 10)
    logits[:, 7] = 5.0  # EOS is the argmax
    logits[:, 3] = 4.0  # then a stop token id
    sampler = Sampler(eos_token_ids=[7])
    rows = [
        _Row("early", SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=[3]), [5]),
        _Row("reached", SamplingParams(max_tokens=8, min_tokens=1, stop_token_ids=[3]), [5]),
        _Row("ignore", SamplingParams(max_tokens=8, min_tokens=4, ignore_eos=True), [5]),
    ]
    out = sampler.sample(logits, rows)
    assert out.token_ids == [0, 7, 7]  # masked: neither 7 nor 3; reached: EOS; ignore_eos: EOS not masked
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_gateway_passes_ignore_eos_and_min_tokens_to_the_engine():
    body = CompletionRequest(model="m", prompt="x", max_tokens=8, ignore_eos=True, min_tokens=3)
    assert body.engine_params() == {"ignore_eos": True, "min_tokens": 3}
    assert CompletionRequest(model="m", prompt="x").engine_params() == {}


def test_our_backends_implement_the_protocol_and_declare_pulls(tiny_model_dirs):
    from replica.backends.sim_engine import SimEngine
    from replica.engine import LLMEngine

    sim = SimBackend(SimEngine(num_blocks=32))
    real = ModelBackend(LLMEngine(next(iter(tiny_model_dirs.values())), num_blocks=32))
    try:
        for backend in (sim, real):
            assert isinstance(backend, EngineBackend)
            assert isinstance(backend.facts, ModelFacts) and backend.facts.pool_tokens == 32 * backend.facts.block_size
            assert backend.capabilities.kv_pull
        assert real.capabilities.logprobs and not sim.capabilities.logprobs
        assert not Capabilities().kv_pull
        assert (sim.facts.engine, real.facts.engine) == ("sim", "model")
        assert sim.pull_peer("r", 1.0) is None and real.pull_peer("r", 1.0) is not None  # only real bytes move
        assert "step_lag" in sim.info_extra() and "kv_pull_bytes_per_s" in sim.load_extra()
    finally:
        sim.shutdown()
        real.shutdown()


class _Record:
    done = False

    def output(self, out) -> None: ...

    def close(self) -> None: ...


def _stream_host(backend, replica_id: str = "me"):
    """The parts of a replica a request's stream reads (replica/serve/request_stream.py StreamHost)."""
    from types import SimpleNamespace

    from replica.serve.replica_settings import ReplicaSettings

    return SimpleNamespace(replica_id=replica_id, draining=False, backend=backend, kv_pull=None, handover=None, audit=None,
                           metrics=SimpleNamespace(request=_Record), settings=ReplicaSettings(engine=SimEngineSettings()))


def test_a_pull_hint_reaches_the_sim_engine_in_the_request_and_only_from_another_replica():
    """The request stream hands the backend the request with its pull hint: the sim engine models
    a pull named by a hint from another replica, none from a hint naming itself; a request the
    backend cannot honour (logprobs on the sim engine) is a 400 that names the field."""
    import asyncio

    from replica.backends.sim_engine import SimEngine
    from replica.serve.request_stream import request_chunks
    from router.protocol.messages import (
        EndChunk,
        ErrorChunk,
        GenerateRequest,
        KvSource,
        RouteDecision,
    )

    backend = SimBackend(SimEngine(num_blocks=64))
    host = _stream_host(backend)

    async def run(route, **params) -> list:
        req = GenerateRequest(prompt_token_ids=list(range(100, 180)), params=SamplingParams(max_tokens=2, **params))
        return [c async for c in request_chunks(host, req, route)]

    try:
        hint = RouteDecision(policy="affinity-pull", reason="pull", replica_id="me", pull=KvSource("other", 3))
        chunks = asyncio.run(run(hint))
        assert isinstance(chunks[-1], EndChunk) and backend.engine.engine.pulls == 1
        own = RouteDecision(policy="affinity-pull", reason="pull", replica_id="me", pull=KvSource("me", 3))
        assert isinstance(asyncio.run(run(own))[-1], EndChunk) and backend.engine.engine.pulls == 1
        refused = asyncio.run(run(None, logprobs=1))[-1]
        assert isinstance(refused, ErrorChunk) and refused.code == 400 and "logprobs" in refused.message
    finally:
        backend.shutdown()


def test_one_request_reaches_each_engine_as_it_is_and_an_engine_refuses_what_it_cannot_honour(tiny_model_dirs):
    """Below the seam the request travels as the one GenerateRequest into each engine's `add`:
    our engine takes pulled K/V (a pull hint alone is only a hint to it), the sim engine models
    the hint and refuses K/V bytes; the priority and the adapter reach the Sequence; an adapter
    roots the sim engine's hashes as it does ours."""
    from replica.backends.sim_engine import SimEngine
    from replica.core.engine_types import InvalidRequestError
    from replica.engine import LLMEngine
    from router.protocol.lora import AdapterRef
    from router.protocol.messages import GenerateRequest, KvSource

    params = SamplingParams(max_tokens=1)
    real = LLMEngine(tiny_model_dirs["llama"], num_blocks=32)
    hinted = GenerateRequest(prompt_token_ids=[5] * 40, params=params, request_id="r2", priority=-1,
                             pull=KvSource("other", 2))
    assert real.add(hinted) == "r2"
    assert real.requests["r2"].priority == -1

    sim = SimEngine(num_blocks=64, max_loras=2)
    with pytest.raises(InvalidRequestError, match="no K/V"):
        sim.add(GenerateRequest(prompt_token_ids=[5] * 40, params=params, request_id="s1"), kv_prefix=object())
    tutor_ref = AdapterRef(name="tutor", path="/adapters/tutor", digest="d1")
    sim.add_adapter(tutor_ref)
    sim.add(GenerateRequest(prompt_token_ids=list(range(40)), params=params, request_id="base"))
    sim.add(GenerateRequest(prompt_token_ids=list(range(40)), params=params, request_id="tutor", adapter=tutor_ref,
                            priority=1))
    base, tutor = sim.requests["base"], sim.requests["tutor"]
    assert tutor.adapter == "tutor" and tutor.priority == 1
    assert base.table.hashes and base.table.hashes[0] != tutor.table.hashes[0]  # no hit across adapters
